"""The command line end to end on a tiny model, and its error handling (exit 2, no traceback)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specc.cli import main


@pytest.fixture(scope="module")
def cli_bundle(models_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    recipe = root / "r.yaml"
    recipe.write_text(
        f"target: {{model: {models_dir / 'target'}}}\n"
        f"draft: {{method: model, model: {models_dir / 'draft'}}}\n"
        "speculation: {k: 3}\nlimits: {max_batch: 4, max_context: 128}\n"
        f"output: {root / 'bundle'}\n"
    )
    assert main(["compile", str(recipe), "-q", "--dump-graphs", str(root / "graphs")]) == 0
    return root / "bundle"


def test_dump_graphs_writes_each_graph_summary_and_code(cli_bundle):
    graphs = cli_bundle.parent / "graphs"
    summary = json.loads((graphs / "target.json").read_text())
    assert summary["role"] == "target" and summary["outputs"] == ["logits", "new_k", "new_v"]
    assert summary["op_counts"]["aten.scaled_dot_product_attention.default"] == 3  # one per layer
    assert "def forward" in (graphs / "draft.py").read_text()


def test_generate_prints_text_and_stats(cli_bundle, capsys):
    assert main(["generate", str(cli_bundle), "--prompt", "hello", "--max-new-tokens", "12"]) == 0
    out, err = capsys.readouterr()
    assert "--- [0] 'hello'" in out
    assert "acceptance rate" in err and "tokens/s" in err


def test_generate_reports_lookup_rounds(bundles, capsys):
    """A draft.lookup bundle: the stats table says how many rounds prompt lookup drafted."""
    assert main(["generate", str(bundles["lookup_first"]), "--prompt", "abcabcabcabc", "--max-new-tokens", "16"]) == 0
    assert "prompt lookup rounds (acceptance)" in capsys.readouterr().err
    assert main(["inspect", str(bundles["lookup_first"])]) == 0
    assert "prompt lookup first (n-grams 2..3)" in capsys.readouterr().out


def test_generate_json_speculative_equals_no_speculation(cli_bundle, capsys):
    args = ["generate", str(cli_bundle), "--prompt", "abc", "--prompt", "xyz=1", "--max-new-tokens", "16", "--json"]
    assert main(args) == 0
    spec = json.loads(capsys.readouterr().out)
    assert main(args + ["--no-speculation"]) == 0
    base = json.loads(capsys.readouterr().out)
    assert spec["completions"] == base["completions"]
    assert spec["stats"]["drafted"] > 0 and base["stats"]["drafted"] == 0


def test_generate_stats_cover_chat_and_plain_prompts(cli_bundle, tmp_path, capsys):
    """A prompts file mixing chat and plain prompts runs as two groups; the stats count both."""
    prompts = tmp_path / "mixed.jsonl"
    prompts.write_text('{"prompt": "abc", "chat": true}\n{"prompt": "xyz=1"}\n{"prompt": "def f(x):"}\n')
    assert main(["generate", str(cli_bundle), "--prompts", str(prompts), "--max-new-tokens", "8", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["requests"] == 3 and stats["new_tokens"] >= 3


def test_generate_stream(cli_bundle, capsys):
    assert main(["generate", str(cli_bundle), "--prompt", "abc", "--max-new-tokens", "10", "--stream", "--no-verify"]) == 0
    assert capsys.readouterr().out.strip()


def test_bench_writes_json(cli_bundle, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def f(x):", "kind": "code"}\n{"prompt": "hi there", "chat": true, "kind": "chat"}\n')
    out = tmp_path / "bench.json"
    assert main(["bench", str(cli_bundle), "--prompts", str(prompts), "--max-new-tokens", "12", "--k", "2", "--k", "3",
                 "--k", "auto", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "specc target-only" in table and "bundle [model] chain k=2" in table
    result = json.loads(out.read_text())
    assert set(result["systems"]) == {"specc target-only", "bundle [model] chain k=2", "bundle [model] chain k=3",
                                      "bundle [model] chain k=auto"}
    for s in result["systems"].values():
        assert s["outputs_equal"] == "2/2" and s["tokens_per_second"] > 0


def test_json_alone_prints_to_stdout_and_json_file_writes_the_file(cli_bundle, tmp_path, capsys):
    """One convention: `--json` puts the JSON alone on stdout (tables go to stderr), `--json FILE` writes it."""
    assert main(["bench", str(cli_bundle), "--prompt", "def f(x):", "--max-new-tokens", "6", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["systems"]["specc target-only"]["outputs_equal"] == "1/1" and "specc target-only" in err
    assert main(["generate", str(cli_bundle), "--prompt", "abc", "--max-new-tokens", "6",
                 "--json", str(tmp_path / "g.json")]) == 0
    out, err = capsys.readouterr()
    assert "--- [0] 'abc'" in out and "tokens/s" in err
    assert len(json.loads((tmp_path / "g.json").read_text())["completions"]) == 1
    assert main(["inspect", str(cli_bundle), "--json", str(tmp_path / "i.json")]) == 0
    assert "graph target" in capsys.readouterr().out
    assert json.loads((tmp_path / "i.json").read_text())["id"].startswith("sha256:")


def test_bench_warms_k_auto_up_on_prompts_outside_the_benchmark(cli_bundle, tmp_path, monkeypatch):
    """k auto's policy learns from every call: before it is timed it answers the warm-up prompts at the
    run's token budget, as a running server has answered earlier requests; fixed k is not warmed so."""
    from specc.bench import run as bench_run
    from specc.prompts import CHAT, warmup_items

    assert not {it["prompt"] for it in warmup_items()} & set(CHAT)
    calls, real = [], bench_run.SpeccSystem.run

    def spy(self, prompts, max_new_tokens):
        calls.append((self.name, len(prompts), max_new_tokens))
        return real(self, prompts, max_new_tokens)

    monkeypatch.setattr(bench_run.SpeccSystem, "run", spy)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def f(x):", "kind": "code"}\n')
    assert main(["bench", str(cli_bundle), "--prompts", str(prompts), "--max-new-tokens", "12", "--k", "2",
                 "--k", "auto"]) == 0
    auto, fixed = "bundle [model] chain k=auto", "bundle [model] chain k=2"
    assert [c for c in calls if c[0] == auto] == [(auto, 1, 4), (auto, 4, 12), (auto, 1, 12)]
    assert [c for c in calls if c[0] == fixed] == [(fixed, 1, 4), (fixed, 1, 12)]


def test_inspect_and_doctor_and_passes(cli_bundle, capsys):
    assert main(["inspect", str(cli_bundle)]) == 0
    out = capsys.readouterr().out
    assert "sizes and sha256 match" in out and "graph target" in out and "graph draft" in out
    assert out.startswith("id          sha256:")
    assert main(["inspect", str(cli_bundle), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["manifest"]["format"] == "specc-bundle" and shown["id"].startswith("sha256:")
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "onnxruntime" in out and "tensorrt" in out and "bfloat16 matmuls: " in out and "\ncpu: " in out
    assert main(["passes"]) == 0
    out = capsys.readouterr().out
    for name in ("add_early_exit", "truncate_to_exit", "replace_causal_mask", "insert_verify_head",
                 "fold_weight_transposes", "quantize_matmul_nbits", "quantize_weight_only_dq", "compute_attention_in_fp64"):
        assert f"{name}:" in out
    assert main(["models", "list"]) == 0
    assert "smollm2-135m-instruct" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["generate", "{bundle}", "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens 0: allowed an integer >= 1"),
    (["generate", "{bundle}", "--prompt", ""], "prompt 0 is empty"),
    (["generate", "{bundle}", "--prompt", "x", "--max-new-tokens", "500"], "above this bundle's max_context 128"),
    (["generate", "{bundle}", "--prompt", "x", "--temperature", "-1"], "temperature must be a number in [0, 100]"),
    (["generate", "{bundle}", "--prompt", "x", "--top-p", "0"], "top_p must be a number in (0, 1]"),
    (["generate", "{bundle}"], "give at least one --prompt"),
    (["generate", "{tmp}/none", "--prompt", "x"], "does not exist"),
    (["compile", "{tmp}/missing.yaml"], "does not exist"),
])
def test_user_errors_exit_2_with_one_message(cli_bundle, tmp_path, capsys, args, message):
    args = [a.format(bundle=cli_bundle, tmp=tmp_path) for a in args]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("specc: error: ") and message in err and "Traceback" not in err


def test_bad_recipe_from_the_console_script(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("target: {model: m}\ndraft: {method: none}\nspeculation: {k: 99}\n")
    proc = subprocess.run([sys.executable, "-m", "specc.cli", "compile", str(recipe)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "recipe field 'speculation.k': 99 is above the maximum 16" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_compile_help_documents_every_field(capsys):
    with pytest.raises(SystemExit):
        main(["compile", "--help"])
    out = capsys.readouterr().out
    for field in ("target.model", "draft.method", "speculation.k", "limits.max_batch", "backend"):
        assert field in out


def test_bench_compares_bundles_and_trees(bundles, tmp_path, capsys):
    """One run: target-only, a chain bundle, and a tree bundle at the recipe's tree and at a --tree override."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("abc abc abc\nhello\n")
    assert main(["bench", str(bundles["draft"]), str(bundles["tree_dynamic"]), "--prompts", str(prompts),
                 "--max-new-tokens", "8", "--tree", "2,2,4", "--tree", "3,2,8", "--json", str(tmp_path / "b.json")]) == 0
    result = json.loads((tmp_path / "b.json").read_text())
    names = list(result["systems"])
    assert names[0] == "specc target-only"
    assert any(n.startswith("draft [model] chain k=3") for n in names)
    assert {"tree_dynamic [model] tree depth 2 x 2, <= 4 nodes",
            "tree_dynamic [model] tree depth 3 x 2, <= 8 nodes"} <= set(names)
    assert all(s["outputs_equal"] == "2/2" for s in result["systems"].values())
    assert result["machine"]["cores"] >= 1 and "- machine: " in (tmp_path / "b.md").read_text()
    assert main(["bench", str(bundles["draft"]), "--prompts", str(prompts), "--tree", "2,x"]) == 2


@pytest.mark.parametrize("error, free, full", [
    (OSError("problem writing element 7 to file"), 2**20, True),  # numpy's tofile: no errno, the disk left full
    (OSError(28, "No space left on device"), 2**30, True),
    (OSError(13, "Permission denied"), 2**30, False),
])
def test_a_full_disk_during_compile_is_named(models_dir, tmp_path, capsys, monkeypatch, error, free, full):
    import shutil

    import specc.compiler as compiler

    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"target: {{model: {models_dir / 'target'}}}\ndraft: {{method: none}}\n"
                      f"limits: {{max_batch: 1, max_context: 64}}\noutput: {tmp_path / 'bundle'}\n")

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(compiler.BundleWriter, "finish", fail)
    monkeypatch.setattr(compiler.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(2**40, 2**40 - free, free))
    assert main(["compile", str(recipe), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("specc: error: ") == 1 and "Traceback" not in err
    assert ("no space left on the disk" in err and f"{free / 2**20:.0f} MiB free" in err) == full
    assert not (tmp_path / "bundle").exists() and not list(tmp_path.glob("bundle*"))


def test_generate_cli_takes_k_auto(bundles, capsys):
    assert main(["generate", str(bundles["draft"]), "--prompt", "abc", "--k", "auto", "--max-new-tokens", "6",
                 "--no-verify", "--json"]) == 0
    assert '"completions"' in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        main(["generate", str(bundles["draft"]), "--prompt", "abc", "--k", "fast"])
    assert info.value.code == 2 and "'auto'" in capsys.readouterr().err
