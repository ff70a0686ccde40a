"""What `specc bench` writes: the results as JSON, a Markdown report and a PNG beside it."""
from __future__ import annotations

import json
from pathlib import Path

from .table import table


def _notes(r: dict) -> str:
    eq, notes = r["equality"], []
    if eq["differs"]:
        firsts = [p["first_difference"] for p in r["per_prompt"] if p["equality"] == "differs"]
        notes.append(f"OUTPUT DIFFERS on {eq['differs']} prompt(s), first at token {min(firsts)}")
    if eq["prefix"]:
        notes.append(f"{eq['prefix']} output(s) equal to the reference's over their common prefix but of another "
                     "length (one stopped earlier; finish reasons per prompt in the JSON)")
    s = r["settings"]
    if "num_assistant_tokens_schedule" in s and s.get("assistant_confidence_threshold"):
        notes.append(f"<= {s['num_assistant_tokens']} drafts, schedule {s['num_assistant_tokens_schedule']}, "
                     f"stops below confidence {s['assistant_confidence_threshold']}")
    if "max_matching_ngram_size" in s:
        notes.append(f"n-grams <= {s['max_matching_ngram_size']}")
    if s.get("note"):
        notes.append(s["note"])
    return "; ".join(notes)


def summary_table(results: dict) -> str:
    """One row per system (and per skipped one): tokens/s, speed-ups, acceptance, time split, equality."""
    ref, compare = results["reference"], results["compare"] == "hf"
    headers = ["system", "tok/s", f"vs {ref}"] + (["vs best hf spec."] if compare else []) + [
        "acceptance", "alpha/token", "tokens/pass", "prefill s", "draft s", "target s", "host s", "equal", "notes"]
    rows = []
    for name, r in results["systems"].items():
        rows.append([name, r["tokens_per_second"], r["speedup_vs_reference"]]
                    + ([r["speedup_vs_best_hf_speculative"]] if compare else [])
                    + [r["acceptance_rate"], r["per_token_acceptance"], r["tokens_per_target_pass"], r["prefill_seconds"],
                       r["draft_seconds"], r["target_seconds"], r["host_seconds"], r["outputs_equal"], _notes(r)])
    for s in results["skipped"]:
        rows.append([f"{s['system']} ({s['bundle']})"] + [None] * (len(headers) - 2) + [f"skipped: {s['reason']}"])
    return table(headers, rows, "l" + "r" * (len(headers) - 2) + "l")


def markdown(results: dict) -> str:
    """The full report: settings, the summary table, acceptance by position, tokens/s per prompt."""
    kinds = ", ".join(f"{n} {k or 'unlabelled'}" for k, n in results["prompt_kinds"].items())
    systems = results["systems"]
    lines = [
        "# specc bench",
        "",
        f"- target: `{results['target']}`; bundles: " + ", ".join(f"`{b}`" for b in results["bundles"]),
        f"- {results['prompts']} prompts ({kinds}), greedy, max_new_tokens {results['max_new_tokens']}, "
        f"batch {results['batch_size']}, {results['repeats']} repeat(s) alternated, median reported",
        f"- reference for speed-ups and token-for-token equality: `{results['reference']}`",
        *([f"- machine: {m['model']}, {m['cores']} cores, kernel flags: {', '.join(m['flags']) or 'none listed'}"]
          if (m := results.get("machine")) else []),
        "",
        "## Summary",
        "",
        summary_table(results),
        "",
        *[f"    {line}" for line in results.get("goal", []) + results.get("bandwidth_lines", [])],
        "acceptance: accepted / drafted tokens; alpha/token: accepted / (accepted + rounds ended by a rejection); "
        "tokens/pass: tokens per target pass, the mean accepted length (accepted drafts per round + 1); "
        "equal: outputs token-for-token equal to the reference's. docs/benchmarks.md has the method.",
    ]
    spec = [n for n, r in systems.items() if r["speculative"] and r["acceptance_by_position"]]
    if spec:
        width = max(len(systems[n]["acceptance_by_position"]) for n in spec)
        lines += ["", "## Acceptance by draft position", "",
                  "Fraction of rounds that drafted position i whose drafts 1..i were all accepted.", "",
                  table(["system"] + [str(i + 1) for i in range(width)],
                        [[n] + systems[n]["acceptance_by_position"] + [None] * (width - len(systems[n]["acceptance_by_position"]))
                         for n in spec])]
    names = list(systems)
    prompts = [[p["prompt"], p["kind"]] for p in systems[names[0]]["per_prompt"]]
    rows = [row + [_cell(systems[n]["per_prompt"][i]) for n in names] for i, row in enumerate(prompts)]
    by_kind = [["all", ""] + [systems[n]["tokens_per_second"] for n in names]]
    if all(systems[n]["tokens_per_second_by_kind"] for n in names):
        for kind in systems[names[0]]["tokens_per_second_by_kind"]:
            by_kind.append([kind, ""] + [systems[n]["tokens_per_second_by_kind"][kind] for n in names])
    lines += ["", "## Tokens/s per prompt", "",
              "`*` marks an output that is not token-for-token the reference's.", "",
              table(["prompt", "kind"] + names, rows + by_kind, "ll" + "r" * len(names))]
    return "\n".join(lines) + "\n"


def _cell(p: dict) -> str:
    tps = p["tokens_per_second"]
    value = "-" if tps is None else f"{tps:.1f}"
    return value + ("" if p["equality"] == "equal" else " *")


def plot(results: dict, path: Path) -> bool:
    """tokens/s per system (bars) and acceptance by draft position (lines); False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    systems = results["systems"]
    names = list(systems)
    spec = [n for n in names if systems[n]["speculative"] and systems[n]["acceptance_by_position"]]
    fig, axes = plt.subplots(1, 2 if spec else 1, figsize=(14 if spec else 8, 0.45 * len(names) + 2), squeeze=False)
    ax = axes[0][0]
    tps = [systems[n]["tokens_per_second"] or 0.0 for n in names]
    colors = ["#888888" if systems[n]["family"] == "hf" else "#1f77b4" for n in names]
    bars = ax.barh(range(len(names)), tps, color=colors)
    for bar, n in zip(bars, names):
        if systems[n]["equality"]["differs"]:
            bar.set_hatch("//")
            bar.set_edgecolor("red")
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.axvline(systems[results["reference"]]["tokens_per_second"] or 0.0, color="black", linestyle=":", linewidth=1)
    ax.set_xlabel("tokens/s (median repeat; dotted: reference; hatched red: output differs)")
    ax.set_title(f"{results['prompts']} prompts, {results['max_new_tokens']} new tokens, greedy")
    if spec:
        ax = axes[0][1]
        for n in spec:
            pos = systems[n]["acceptance_by_position"]
            xs = [i + 1 for i, a in enumerate(pos) if a is not None]
            ax.plot(xs, [a for a in pos if a is not None], marker="o",
                    linestyle="--" if systems[n]["family"] == "hf" else "-", label=n)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("draft position")
        ax.set_ylabel("fraction of rounds accepted up to here")
        ax.set_ylim(0, 1.02)
        ax.set_title("acceptance by draft position")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_outputs(results: dict, json_path: Path) -> list[Path]:
    """results as JSON at json_path, with the Markdown report (.md) and the plot (.png) beside it."""
    json_path.parent.mkdir(parents=True, exist_ok=True)
    md, png = json_path.with_suffix(".md"), json_path.with_suffix(".png")
    if plot(results, png):
        results["plot"] = str(png)
    else:
        results["plot"] = None
        print("matplotlib is not installed: no plot (pip install 'specc[bench]')")
    md.write_text(markdown(results) + (f"\n![tokens/s and acceptance]({png.name})\n" if results["plot"] else ""))
    json_path.write_text(json.dumps(results, indent=2))
    return [json_path, md] + ([png] if results["plot"] else [])
