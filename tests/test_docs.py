"""The documentation a user reads: Markdown that renders, commands that parse, figures that match
their results files, no lab-notebook history."""
from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from specc.bench import results
from specc.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
RESULTS = sorted((ROOT / "docs" / "results").glob("*.json"))
USER_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^\s*(`{3,}|~{3,})(.*)$")


def markdown_files() -> list[Path]:
    """Every Markdown file git knows in the repository (tracked or not ignored)."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.md"], cwd=ROOT, check=False,
                         capture_output=True, text=True)
    if out.returncode != 0:  # not a git checkout: walk the tree, skipping environments
        return [p for p in ROOT.rglob("*.md") if not any(part.startswith(".") for part in p.relative_to(ROOT).parts)]
    return [ROOT / line for line in out.stdout.splitlines() if (ROOT / line).is_file()]


def unclosed_fence(text: str) -> int | None:
    """The line number of a code fence that is never closed (CommonMark: the closing fence uses the
    opening's character, at least as many, and nothing after it), else None."""
    open_at, char, length = None, "", 0
    for n, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if not m:
            continue
        fence, rest = m.group(1), m.group(2)
        if open_at is None:
            open_at, char, length = n, fence[0], len(fence)
        elif fence[0] == char and len(fence) >= length and not rest.strip():
            open_at = None
    return open_at


def code_blocks(text: str) -> list[tuple[int, str, list[str]]]:
    """(first line number, info string, lines) of each fenced block."""
    blocks, current = [], None
    for n, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if current is None and m:
            current = (n + 1, m.group(2).strip(), [], m.group(1))
        elif current is not None and m and m.group(1)[0] == current[3][0] and len(m.group(1)) >= len(current[3]) \
                and not m.group(2).strip():
            blocks.append(current[:3])
            current = None
        elif current is not None:
            current[2].append(line)
    return blocks


def specc_commands(path: Path) -> list[tuple[int, list[str]]]:
    """(line, argv after `specc`) of every specc command in the shell blocks of a Markdown file."""
    found = []
    for start, info, lines in code_blocks(path.read_text()):
        if info and info.split()[0] not in ("bash", "sh", "shell", "console"):
            continue  # python, yaml, json, text output ...
        logical, first = "", None
        for n, line in enumerate(lines, start):
            if first is None:
                first = n
            if line.rstrip().endswith("\\"):
                logical += line.rstrip()[:-1] + " "
                continue
            logical, at, first = logical + line, first, None
            words = shlex.split(logical.strip().removeprefix("$ "), comments=True)
            logical = ""
            for i, w in enumerate(words):
                if w == "specc" or w.endswith("/specc"):
                    if all("=" in x for x in words[:i]):  # VAR=value specc ...
                        found.append((at, words[i + 1:]))
                    break
    return found


def test_every_markdown_file_has_balanced_fences():
    files = markdown_files()
    assert ROOT / "README.md" in files
    bad = {str(p.relative_to(ROOT)): line for p in files if (line := unclosed_fence(p.read_text())) is not None}
    assert not bad, f"code fences opened and never closed (file: line): {bad}"


def test_fence_checker_finds_a_stray_fence():
    assert unclosed_fence("```\na\n```\n") is None
    assert unclosed_fence("````\n```\n````\n") is None
    assert unclosed_fence("```python\nx\n```\ntext\n```\n") == 5


COMMANDS = [(p, line, argv) for p in USER_DOCS for line, argv in specc_commands(p)]


def test_the_docs_show_commands():
    assert len(COMMANDS) > 20
    assert {argv[0] for _, _, argv in COMMANDS} >= {"compile", "generate", "bench", "serve", "triton", "tune"}


@pytest.mark.parametrize("path,line,argv", COMMANDS, ids=[f"{p.name}:{line}" for p, line, _ in COMMANDS])
def test_every_command_in_the_docs_parses(path, line, argv):
    """Each `specc ...` command shown in README.md and docs/ is accepted by the real argument parser
    (nothing runs: the parser only reads the words)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            build_parser().parse_args(argv)
        except SystemExit as exc:
            assert exc.code == 0, f"{path.name}:{line}: `specc {shlex.join(argv)}` does not parse: {err.getvalue()}"


def _in_blocks(path: Path) -> list[str]:
    return [line for _, info, lines in code_blocks(path.read_text()) if info not in ("python", "yaml", "json")
            for line in lines]


def test_readme_has_two_setup_commands_and_no_pipes():
    lines = _in_blocks(ROOT / "README.md")
    setup = [ln.strip() for ln in lines if re.match(r"\s*(make|pip|python3? -m pip|\.venv/bin/pip)\b", ln)]
    assert setup == ["make demo", "make test"]
    for p in USER_DOCS:
        piped = [ln for ln in _in_blocks(p) if re.search(r"\|\s*specc\b", ln)]
        assert not piped, f"{p.name}: a command piped into specc, pasteable by mistake: {piped}"


def test_rendered_figures_agree_with_their_results_files():
    """Every results region of README.md and docs/*.md, and the generated recipe reference, equal what
    `specc report` renders (regenerate: specc report docs/results/*.json --write README.md docs/*.md)."""
    assert results.report(RESULTS, check=USER_DOCS) == 0


def test_a_stale_figure_is_caught(tmp_path):
    doc = tmp_path / "d.md"
    run = results.load(RESULTS[0])
    sid = run["systems"][-1]["id"]
    doc.write_text(f"<!-- results:{run['run']} ratio {sid} -->0.01x<!-- /results -->\n")
    with pytest.raises(results.SpeccError, match="disagrees"):
        results.report(RESULTS, check=[doc])
    results.report(RESULTS, write=[doc])
    assert results.report(RESULTS, check=[doc]) == 0
    assert "0.01x" not in doc.read_text()


def test_every_results_file_is_complete_and_cited():
    cited = "\n".join(p.read_text() for p in USER_DOCS)
    assert RESULTS
    for path in RESULTS:
        data = json.loads(path.read_text())
        # a kernel run (scripts/bench_kernels.py) times one layer: no prompts, no reference system
        needed = ("command", "rows") if data.get("kind") == "kernels" else ("prompt_set", "reference")
        for field in ("date", "machine", "provenance", "systems", *needed):
            assert data.get(field), f"{path.name}: no {field}"
        assert {"model", "cores", "flags"} <= set(data["machine"]), f"{path.name}: machine needs model, cores, flags"
        assert data["provenance"] in ("measured", "reconstructed")
        if data["provenance"] == "reconstructed":
            assert data.get("provenance_note"), f"{path.name}: say what the reconstruction is from"
        assert f"results:{path.stem}" in cited or f",{path.stem}" in cited, f"{path.name} backs no claim in the docs"


def test_bench_json_output_renders(tmp_path):
    """What `specc bench --json` writes (specc/bench/run.py: run_bench) loads and renders as it is."""
    system = {"tokens_per_second": 40.0, "speedup_vs_reference": 1.25, "acceptance_rate": 0.3,
              "per_token_acceptance": 0.5, "tokens_per_target_pass": 1.5, "acceptance_by_position": [0.4, 0.3, None],
              "prefill_seconds": 1.0, "draft_seconds": 0.1, "target_seconds": 20.0, "host_seconds": 0.2,
              "family": "specc", "speculative": True, "settings": {},
              "equality": {"equal": 8, "prefix": 0, "differs": 0, "of": 8},
              "equality_reference": "specc target-only", "outputs_equal": "8/8", "per_prompt": []}
    bench = {"reference": "specc target-only", "compare": None, "max_new_tokens": 64, "prompts": 8,
             "prompt_kinds": {"chat": 4, "code": 4}, "repeats": 1, "batch_size": 1, "bundles": ["bundles/quickstart"],
             "target": "smollm2-135m-instruct", "skipped": [],
             "machine": {"model": "Some CPU", "cores": 2, "flags": ["avx2"], "native_bfloat16": False, "int8_dot_product": False},
             "systems": {"specc target-only": {**system, "tokens_per_second": 32.0, "speedup_vs_reference": 1.0,
                                               "speculative": False, "acceptance_by_position": []},
                         "quickstart [prompt_lookup] chain k=4": system}}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench))
    md = results.render([path])
    doc = tmp_path / "x.md"
    doc.write_text("<!-- results:bench ratio quickstart-prompt-lookup-chain-k-4 --><!-- /results -->")
    results.report([path], write=[doc])
    assert "| quickstart [prompt_lookup] chain k=4 | 40.00 | 1.25 |" in md
    assert "Some CPU, 2 cores (kernel flags: avx2)" in md
    assert "1.25x" in doc.read_text()


def test_report_command_exit_codes(tmp_path, capsys):
    from specc.cli import main

    doc = tmp_path / "d.md"
    run = results.load(RESULTS[0])
    doc.write_text(f"<!-- results:{run['run']} date -->yesterday<!-- /results -->\n")
    assert main(["report", *map(str, RESULTS), "--check", str(doc)]) == 2
    assert "disagrees" in capsys.readouterr().err
    assert main(["report", *map(str, RESULTS), "--write", str(doc)]) == 0
    assert main(["report", *map(str, RESULTS), "--check", str(doc)]) == 0
    doc.write_text("<!-- results:no-such-run --><!-- /results -->\n")
    assert main(["report", *map(str, RESULTS), "--check", str(doc)]) == 2


def _grep(pattern: str, paths: list[str]) -> list[str]:
    out = subprocess.run(["grep", "-rnE", pattern, *paths], cwd=ROOT, capture_output=True, text=True, check=False)
    return out.stdout.splitlines()


def test_user_docs_carry_no_session_history():
    """'stop N' was a work session's number, meaningless to users (and 'stop' means draft.stop_below and
    stop strings); issue numbers and diary lines belong in the tracker, not the docs."""
    assert not _grep(r"[Ss]top [0-9]", ["docs", "README.md", "recipes", "CHANGELOG.md"])
    assert not _grep(r"[Ii]ssue[ -]?[0-9]|my mistake|lost with (its|the|their) machine", ["docs", "README.md", "recipes"])


def test_code_carries_no_session_history():
    """Code comments explain the code; history and measurements belong in docs/results and CHANGELOG.md."""
    hits = _grep(r"[Ss]top [0-9]", ["specc"])
    assert not hits, "\n".join(hits)


def test_relative_links_resolve():
    link = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
    broken = []
    for p in markdown_files():
        for target in link.findall(p.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (p.parent / target).exists():
                broken.append(f"{p.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def test_mixed_16_is_the_first_half_of_each_kind_of_mixed_32():
    """The 16-prompt set the Qwen results use: the first 8 code and first 8 chat prompts of mixed-32."""
    prompts = ROOT / "examples" / "prompts"
    rows = [json.loads(line) for line in (prompts / "mixed-32.jsonl").read_text().splitlines() if line.strip()]
    expected = [r for r in rows if r["kind"] == "code"][:8] + [r for r in rows if r["kind"] == "chat"][:8]
    got = [json.loads(line) for line in (prompts / "mixed-16.jsonl").read_text().splitlines() if line.strip()]
    assert got == expected


def test_recipe_reference_is_what_the_schema_generates():
    """docs/recipes.md's reference is rendered from the schema `specc compile --help` prints; after a
    schema change: specc report docs/results/*.json --write docs/recipes.md"""
    text = (ROOT / "docs" / "recipes.md").read_text()
    assert "<!-- generated:recipe-schema -->" in text
    assert results.fill(text, {}) == text
    reference = results.recipe_reference()
    from specc.recipe import describe_schema

    for line in describe_schema():
        path = line.strip().split(" ")[0].rstrip(":")
        assert f"`{path}`" in reference, f"{path} missing from the reference"


def test_kinds_view_reports_each_category_against_the_reference():
    """`results:RUN kinds`: tok/s of every system per prompt kind, with its ratio to the reference on that kind."""
    run = results.load(ROOT / "docs" / "results" / "2026-12-07-qwen-int4gemm-llamacpp-zen5.json")
    text = results.render_region("2026-12-07-qwen-int4gemm-llamacpp-zen5 kinds", {run["run"]: run})
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert {"code", "chat", "all"} <= set(rows)
    ref = next(s for s in run["systems"] if s["name"] == run["reference"])
    other = next(s for s in run["systems"] if s["name"] != run["reference"])
    ratio = other["tokens_per_second_by_kind"]["code"] / ref["tokens_per_second_by_kind"]["code"]
    assert f"({ratio:.2f}x)" in rows["code"]
    with pytest.raises(results.SpeccError, match="a table shows one run"):
        results.render_region(f"{run['run']},{run['run']} kinds", {run["run"]: run})


def test_kernel_table_states_the_pass_against_the_copy_bandwidth_beside_it():
    """A pass table with wall pairs (scripts/bench_kernels.py --wall-pairs) states their median share and range."""
    run = results.load(ROOT / "docs" / "results" / "2026-12-07-kernels-passes-zen5-c.json")
    assert "copy bandwidth measured just before it" not in results.kernel_table(run)
    pairs = [{"copy_gb_per_second": 40.0, "pass_ms": 25.0, "share": s} for s in (0.8, 0.9, 0.7)]
    text = results.kernel_table({**run, "wall": {"pairs": pairs, "median_share": 0.8, "min_share": 0.7, "max_share": 0.9}})
    assert "3 pairs: the weights' memory time is 80% of the pass's time (median; 70% to 90%)" in text
    llama = {"pairs": pairs, "median_share": 0.75, "min_share": 0.7, "max_share": 0.9, "binary": "llama-bench",
             "gguf": "q.gguf", "weight_bytes": 980e6}
    wall = {"pairs": pairs, "median_share": 0.8, "min_share": 0.7, "max_share": 0.9, "llamacpp": llama}
    text = results.kernel_table({**run, "wall": wall})
    assert "q.gguf, 980 MB of weights a token), taking turns with it: 75% (70% to 90%)" in text
