"""Benchmark results as data: render `docs/results/*.json` into the Markdown that cites them.

A results file is what `specc bench --json` writes (the top-level `systems` mapping, `reference`,
`machine`, `prompts`, ...), optionally with the fields that make a run citable on its own:
`title`, `date`, `prompt_set`, `command`, `weights`, `provenance` ("measured": the file is a
`specc bench` result; "reconstructed": rebuilt from earlier prose or tables, not re-run) and
`provenance_note`. A system may carry an `id` (else its name, lower-cased, non-alphanumerics as
`-`), a `note`, and any of bench's per-system figures.

Markdown files cite runs through marked regions, which `specc report --write` fills and
`specc report --check` compares:

    <!-- results:RUN -->...<!-- /results -->                    the run's table with its caption
    <!-- results:RUN kinds -->...<!-- /results -->              tok/s by prompt kind (a Spec-Bench category), each system
    <!-- results:RUN ratio SYSTEM -->1.34x<!-- /results -->      SYSTEM's speed-up over the reference
    <!-- results:RUN ratio A vs B -->1.32x<!-- /results -->      A's tok/s over B's
    <!-- results:RUN tok/s SYSTEM -->42.62<!-- /results -->
    <!-- results:RUN equal SYSTEM -->32/32<!-- /results -->
    <!-- results:RUN machine -->...<!-- /results -->             CPU model and kernel flags
    <!-- results:RUN date -->2026-12-05<!-- /results -->

RUN is a results file's stem; `RUN1,RUN2` gives the range over several runs (`1.32-1.41x`).

`<!-- generated:recipe-schema -->...<!-- /generated -->` holds the recipe reference, rendered from
the schema (`specc.recipe.describe_schema`, what `specc compile --help` prints) by the same command.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from ..errors import SpeccError

REGION = re.compile(r"<!-- results:(?P<spec>[^>]*?) -->(?P<body>.*?)<!-- /results -->", re.DOTALL)
VIEWS = ("table", "kinds", "ratio", "tok/s", "equal", "machine", "date")
GENERATED = re.compile(r"<!-- generated:(?P<spec>[\w-]+) -->(?P<body>.*?)<!-- /generated -->", re.DOTALL)
FIELD = re.compile(r"^\s*(?P<path>[\w.]+)(?: \((?P<default>[^)]*)\))?(?P<allowed>(?: \[[^\]]*\])*): (?P<help>.*)$")


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def load(path: Path) -> dict:
    """One results file, checked and normalised: `systems` becomes a list of dicts with `name` and `id`."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise SpeccError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict) or not isinstance(data.get("systems"), dict) or not data["systems"]:
        raise SpeccError(f"{path}: a results file needs a 'systems' object (what `specc bench --json` writes)")
    systems = []
    for name, s in data["systems"].items():
        if not isinstance(s, dict):
            raise SpeccError(f"{path}: systems.{name} must be an object")
        for field in ("tokens_per_second", "speedup_vs_reference"):
            if s.get(field) is not None and not isinstance(s[field], (int, float)):
                raise SpeccError(f"{path}: systems.{name}.{field} must be a number or null")
        systems.append({**s, "name": name, "id": s.get("id") or slug(name)})
    ids = [s["id"] for s in systems]
    if len(set(ids)) != len(ids):
        raise SpeccError(f"{path}: system ids repeat: {sorted({i for i in ids if ids.count(i) > 1})}")
    return {**data, "run": path.stem, "path": str(path), "systems": systems}


def _system(run: dict, key: str) -> dict:
    for s in run["systems"]:
        if key in (s["id"], s["name"]):
            return s
    raise SpeccError(f"results {run['run']!r} has no system {key!r}; its ids: " + ", ".join(s["id"] for s in run["systems"]))


def _num(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def machine_text(run: dict) -> str:
    m = run.get("machine") or {}
    model = m.get("model") or "CPU model not recorded"
    cores = f", {m['cores']} cores" if m.get("cores") else ""
    flags = m.get("flags")
    flags = f" (kernel flags: {', '.join(flags)})" if flags else " (kernel flags not recorded)" if flags is None else ""
    return f"{model}{cores}{flags}"


def _ratio(run: dict, args: str) -> float:
    a, _, b = args.partition(" vs ")
    sa = _system(run, a.strip())
    if not b:
        if sa.get("speedup_vs_reference") is not None:
            return sa["speedup_vs_reference"]
        ref = _system(run, run["reference"]) if run.get("reference") else None
        b_tps = ref and ref.get("tokens_per_second")
        if not b_tps or sa.get("tokens_per_second") is None:
            raise SpeccError(f"results {run['run']!r}: no speed-up recorded for {a.strip()!r}")
        return sa["tokens_per_second"] / b_tps
    sb = _system(run, b.strip())
    if not sa.get("tokens_per_second") or not sb.get("tokens_per_second"):
        raise SpeccError(f"results {run['run']!r}: 'ratio {args}' needs both systems' tokens_per_second")
    return sa["tokens_per_second"] / sb["tokens_per_second"]


def _value(run: dict, view: str, args: str):
    if view == "ratio":
        return _ratio(run, args)
    if view == "tok/s":
        tps = _system(run, args).get("tokens_per_second")
        if tps is None:
            raise SpeccError(f"results {run['run']!r}: no tokens_per_second for {args!r}")
        return tps
    if view == "equal":
        return _equal(run, _system(run, args), bare=True)
    if view == "machine":
        return machine_text(run)
    if view == "date":
        return run.get("date") or "date not recorded"
    raise SpeccError(f"unknown results view {view!r}; allowed: {', '.join(VIEWS)}")


def _equal(run: dict, s: dict, bare: bool = False) -> str:
    eq = s.get("outputs_equal")
    if eq is None and isinstance(s.get("equality"), dict):
        eq = f"{s['equality'].get('equal')}/{s['equality'].get('of')}"
    if eq is None:
        return "-"
    ref = s.get("equality_reference")
    if not bare and ref and ref != run.get("reference"):
        return f"{eq} †"
    return eq


def caption(run: dict) -> str:
    kinds = run.get("prompt_kinds") or {}
    kinds = " (" + ", ".join(f"{n} {k}" for k, n in kinds.items()) + ")" if kinds else ""
    prompts = f"{run['prompts']} prompts{kinds}" if run.get("prompts") else "prompts not recorded"
    if run.get("prompt_set"):
        prompts += f" from `{run['prompt_set']}`"
    repeats = run.get("repeats")
    setting = (f"{run.get('max_new_tokens', '?')} new tokens, greedy, batch {run.get('batch_size', 1)}, "
               f"{repeats} repeat{'s' if repeats != 1 else ''}" + (" (median)" if repeats and repeats > 1 else ""))
    if run.get("provenance") == "reconstructed":
        source = "reconstructed from earlier documentation, not re-run"
    else:  # runs of another benchmark script name it (`measured_by`)
        source = f"measured by `{run.get('measured_by') or 'specc bench --json'}`"
    return (f"Run `{run['run']}` ({source}): {run.get('date') or 'date not recorded'}, {machine_text(run)}; "
            f"{prompts}; {setting}. Reference: {run.get('reference') or 'not recorded'}.")


def kernel_table(run: dict) -> str:
    """A kernel run (scripts/bench_kernels.py): ms per call by pass rows, the cost of the 5-row pass over the 1-row
    one, and MACs per second at the widest pass against the CPU's integer dot-product peak."""
    rows = [str(m) for m in run["rows"]]
    head = ["kernel", *[f"M={m}" for m in rows], "M=5 / M=1" if "5" in rows and "1" in rows else None,
            f"GMAC/s at M={rows[-1]}", "of dot peak"]
    head = [h for h in head if h is not None]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for s in run["systems"]:
        ms = s["ms"]
        cells = [s.get("label") or s["name"], *[_num(ms.get(m), 3) for m in rows]]
        if "5" in rows and "1" in rows:
            cells.append(_num(ms["5"] / ms["1"]))
        share = s.get("share_of_dot_peak")
        cells += [_num(s.get("gmac_per_second"), 0), f"{100 * share:.0f}%" if share is not None else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("| memory time of the int4 weights | " + " | ".join([_num(run["memory_ms"], 3)] + [""] * (len(head) - 2)) + " |")
    wall = run.get("wall")
    if wall:
        lines += ["", f"A 1-token target pass against the copy bandwidth measured just before it, {len(wall['pairs'])} "
                      f"pairs: the weights' memory time is {100 * wall['median_share']:.0f}% of the pass's time "
                      f"(median; {100 * wall['min_share']:.0f}% to {100 * wall['max_share']:.0f}%)."]
        llama = wall.get("llamacpp")
        if llama:
            lines[-1] += (f" llama.cpp's decoding (`{llama['binary']}`, {llama['gguf']}, {llama['weight_bytes'] / 1e6:.0f} MB "
                          f"of weights a token), taking turns with it: {100 * llama['median_share']:.0f}% "
                          f"({100 * llama['min_share']:.0f}% to {100 * llama['max_share']:.0f}%).")
    peaks = ", ".join(f"{isa} {v:.0f}" for isa, v in run.get("dot_peak_gmac_per_second", {}).items())
    note = (f"*Run `{run['run']}` (measured by `{run.get('measured_by')}`): {run.get('date')}, {machine_text(run)}; "
            f"{run['title']}, {run.get('threads')} threads, median ms per call; "
            f"int4 weights {run['int4_weight_bytes'] / 1e6:.2f} MB, "
            f"copy bandwidth {run['copy_gb_per_second']:.1f} GB/s; integer dot peak (GMAC/s): {peaks}.*")
    return "\n".join([note, ""] + lines)


def table(run: dict) -> str:
    """The run's systems as a Markdown table, under a one-line caption naming its date and machine."""
    if run.get("kind") == "kernels":
        return kernel_table(run)
    systems = run["systems"]
    ref = run.get("reference") or "reference"
    cols = [("system", lambda s: s.get("label") or s["name"], "---"),
            ("tok/s", lambda s: _num(s.get("tokens_per_second")), "---:"),
            (f"vs {ref}", lambda s: _num(_safe_ratio(run, s)), "---:")]
    if any(s.get("tokens_per_target_pass") is not None for s in systems):
        cols.append(("tokens/pass", lambda s: _num(s.get("tokens_per_target_pass")), "---:"))
    if not any(s.get("acceptance_by_position") for s in systems) and any(s.get("acceptance_rate") is not None for s in systems):
        cols.append(("acceptance", lambda s: _num(s.get("acceptance_rate")), "---:"))
    if any(s.get("acceptance_by_position") for s in systems):
        cols.append(("acceptance by position",
                     lambda s: " ".join(_num(a) for a in s.get("acceptance_by_position") or [] if a is not None) or "-", "---"))
    cols.append(("equal", lambda s: _equal(run, s), "---:"))
    if any(s.get("note") for s in systems):
        cols.append(("note", lambda s: s.get("note") or "", "---"))
    lines = ["| " + " | ".join(c[0] for c in cols) + " |", "|" + "|".join(c[2] for c in cols) + "|"]
    for s in systems:
        lines.append("| " + " | ".join(str(c[1](s)).replace("|", "\\|") for c in cols) + " |")
    others = sorted({s["equality_reference"] for s in systems
                     if s.get("equality_reference") and s["equality_reference"] != run.get("reference")})
    if others:
        lines += ["", "† equal to " + " / ".join(f"`{o}`" for o in others) + "'s output, not the reference's."]
    return "\n".join([f"*{caption(run)}*", ""] + lines)


def kinds_table(run: dict) -> str:
    """Tokens/s of every system on each kind of prompt (Spec-Bench's categories, code, chat), and its ratio to the
    reference on that kind, as Spec-Bench's leaderboard reports."""
    systems = [s for s in run["systems"] if s.get("tokens_per_second_by_kind")]
    if not systems:
        raise SpeccError(f"results {run['run']!r} records no tokens/s by prompt kind")
    ref = next((s for s in systems if s["name"] == run.get("reference")), systems[0])
    kinds = list(ref["tokens_per_second_by_kind"])
    head = ["kind", *[s.get("label") or s["name"] for s in systems]]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * len(systems)]

    def cell(s: dict, kind: str | None) -> str:
        got = s["tokens_per_second"] if kind is None else s["tokens_per_second_by_kind"].get(kind)
        base = ref["tokens_per_second"] if kind is None else ref["tokens_per_second_by_kind"].get(kind)
        if got is None:
            return "-"
        return f"{got:.2f}" + ("" if s is ref or not base else f" ({got / base:.2f}x)")

    for kind in kinds:
        lines.append("| " + " | ".join([kind, *[cell(s, kind) for s in systems]]) + " |")
    lines.append("| all | " + " | ".join(cell(s, None) for s in systems) + " |")
    note = (f"*Run `{run['run']}`: tokens/s by prompt kind ({run.get('prompts')} prompts), "
            f"in brackets the ratio to {ref.get('label') or ref['name']} on the same prompts.*")
    return "\n".join([note, ""] + lines)


def _safe_ratio(run: dict, s: dict):
    try:
        return _ratio(run, s["id"])
    except SpeccError:
        return None


def render_region(spec: str, runs: dict[str, dict]) -> str:
    """The text a region `<!-- results:SPEC -->` holds."""
    names, _, rest = spec.strip().partition(" ")
    view, _, args = rest.strip().partition(" ")
    view, args = view or "table", args.strip()
    if view not in VIEWS:
        raise SpeccError(f"region 'results:{spec}': unknown view {view!r}; allowed: {', '.join(VIEWS)}")
    selected = []
    for name in names.split(","):
        if name not in runs:
            raise SpeccError(f"region 'results:{spec}' names run {name!r}, which is not among the results files given")
        selected.append(runs[name])
    if view in ("table", "kinds"):
        if len(selected) != 1:
            raise SpeccError(f"region 'results:{spec}': a table shows one run")
        return "\n" + (table if view == "table" else kinds_table)(selected[0]) + "\n"
    if view in ("ratio", "tok/s") and not args:
        raise SpeccError(f"region 'results:{spec}': '{view}' needs a system id")
    values = [_value(r, view, args) for r in selected]
    if view in ("ratio", "tok/s"):
        unit = "x" if view == "ratio" else ""
        lo, hi = f"{min(values):.2f}", f"{max(values):.2f}"
        return (lo if lo == hi else f"{lo}-{hi}") + unit
    distinct = list(dict.fromkeys(values))
    return distinct[0] if len(distinct) == 1 else "; ".join(distinct)


def recipe_reference() -> str:
    """Every recipe field as Markdown tables, one per section, from the schema `specc compile --help` prints."""
    from ..recipe import describe_schema

    out, rows, section = [], [], [""]

    def flush():
        if rows:
            out.extend(["", "| field | default | allowed | meaning |", "|---|---|---|---|", *rows])
            rows.clear()

    for line in describe_schema():
        m = FIELD.match(line)
        if not m:
            rows.append(f"| | | | {line.strip()} |")
            continue
        path, default, allowed, help_ = m["path"], m["default"], m["allowed"], m["help"].replace("|", "\\|")
        if default is None and not allowed:  # a section
            flush()
            section[0] = path.split(".")[0]
            out.extend(["", f"### `{path}`", "", help_[:1].upper() + help_[1:] + "."])
            continue
        if "." not in path and section[0] != "top":  # a top-level field after a section
            flush()
            section[0] = "top"
            out.extend(["", "### Top-level fields" + (" (continued)" if "### Top-level fields" in out else "")])
        default = default.removeprefix("default ").strip() if default else ""
        default = "**required**" if default == "required" else f"`{default}`" if default else ""
        allowed = " ".join(a.strip() for a in allowed.split("] [")).strip().strip("[]").replace("|", ", ")
        rows.append(f"| `{path}` | {default} | {allowed} | {help_} |")
    flush()
    return "\n".join(out) + "\n"


def _generated(spec: str) -> str:
    if spec == "recipe-schema":
        return recipe_reference()
    raise SpeccError(f"unknown generated region {spec!r}; known: recipe-schema")


def fill(text: str, runs: dict[str, dict]) -> str:
    """text with every results region re-rendered from runs, and every generated region from the code."""
    text = REGION.sub(lambda m: f"<!-- results:{m['spec']} -->{render_region(m['spec'], runs)}<!-- /results -->", text)
    return GENERATED.sub(lambda m: f"<!-- generated:{m['spec']} -->{_generated(m['spec'])}<!-- /generated -->", text)


def regions(text: str) -> list[str]:
    return [m["spec"] for m in REGION.finditer(text)]


def load_all(paths: list[Path]) -> dict[str, dict]:
    runs: dict[str, dict] = {}
    for p in paths:
        run = load(Path(p))
        if run["run"] in runs:
            raise SpeccError(f"two results files named {run['run']!r}: {runs[run['run']]['path']} and {p}")
        runs[run["run"]] = run
    return runs


def render(results_files: list[Path]) -> str:
    """Every run's table, one section each, as Markdown."""
    out = []
    for run in load_all(results_files).values():
        out += [f"## {run.get('title') or run['run']}", "", table(run), ""]
    return "\n".join(out)


def report(results_files: list[Path], write: list[Path] = (), check: list[Path] = ()) -> int:
    """`specc report`: print every table, or fill the regions of `write` files, or compare those of `check`
    files (exit code 2, naming each file and region that disagrees)."""
    runs = load_all(results_files)
    if not write and not check:
        print(render(results_files))
        return 0
    stale = []
    for md in list(write) + list(check):
        md = Path(md)
        text = md.read_text()
        try:
            new = fill(text, runs)
        except SpeccError as exc:
            raise SpeccError(f"{md}: {exc}") from None
        if md in map(Path, write):
            if new != text:
                md.write_text(new)
                print(f"written: {md}")
            continue
        for pattern, kind in ((REGION, "results"), (GENERATED, "generated")):
            for old, fresh in zip(pattern.finditer(text), pattern.finditer(new)):
                if old["body"] != fresh["body"]:
                    line = text.count("\n", 0, old.start()) + 1
                    stale.append(f"{md}:{line}: region '{kind}:{old['spec']}' disagrees with what it is rendered from")
    if stale:
        raise SpeccError(stale[0], details=stale[1:] + ["run `specc report docs/results/*.json --write FILE...` to re-render"])
    return 0
