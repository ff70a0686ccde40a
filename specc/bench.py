"""`specc bench`: speculative vs target-only on the same compiled target, same prompts, one run.

Systems are alternated within each repeat so machine noise hits all of them alike; the
median repeat is reported. Greedy outputs are compared token for token.
"""
from __future__ import annotations

import json
from pathlib import Path

from .errors import SpeccError
from .report import table


def read_prompts(path: Path, default_chat: bool = False) -> list[dict]:
    """JSON lines ({"prompt": str, "chat": bool?, "kind": str?}) or plain text, one prompt per line."""
    path = Path(path)
    if not path.is_file():
        raise SpeccError(f"prompts file {path} does not exist")
    items = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SpeccError(f"{path}:{n}: not valid JSON ({exc})") from None
            if not isinstance(obj.get("prompt"), str) or not obj["prompt"]:
                raise SpeccError(f"{path}:{n}: needs a non-empty string field \"prompt\"")
            items.append({"prompt": obj["prompt"], "chat": bool(obj.get("chat", default_chat)), "kind": obj.get("kind", "")})
        else:
            items.append({"prompt": line.encode().decode("unicode_escape"), "chat": default_chat, "kind": ""})
    if not items:
        raise SpeccError(f"prompts file {path} holds no prompts")
    return items


def _run_system(model, items: list[dict], batch_size: int, **kwargs) -> dict:
    """Generate every prompt; per-prompt token ids and stats summed over the calls."""
    from .runtime.engine import RunStats

    tokens, per_prompt, total = {}, [], RunStats()
    for chat in (False, True):
        idx = [i for i, it in enumerate(items) if it["chat"] == chat]
        for lo in range(0, len(idx), batch_size):
            chunk = idx[lo:lo + batch_size]
            for c in model.generate([items[i]["prompt"] for i in chunk], chat=chat, **kwargs):
                tokens[chunk[c.index]] = c.token_ids
                per_prompt.append({"prompt": chunk[c.index], "new_tokens": len(c.token_ids), **c.stats})
            total.merge(model.last_stats)
    return {"summary": total.to_dict(), "tokens": [tokens[i] for i in range(len(items))], "per_prompt": per_prompt}


def _systems(models: list, k_values: list[int], trees: list) -> list[tuple[str, object, dict]]:
    """(label, model, generate kwargs) for target-only and every speculative variant asked for."""
    systems = [("specc target-only", models[0], {"speculative": False})]
    for model in models:
        if not model.can_speculate:
            continue
        name = model.bundle.path.name
        variants = [(f"chain k={k}", {"k": k}) for k in k_values]
        if model.target.has_tree_mask and model.draft_method != "prompt_lookup":
            variants += [(t.label, {"tree": t}) for t in trees]
        if not variants:
            variants = [(model.tree.label if model.tree else f"chain k={model.k}", {})]
        systems += [(f"{name} [{model.draft_method}] {label}", model, {"speculative": True, **kw}) for label, kw in variants]
    return systems


def run_bench(models: list, items: list[dict], max_new_tokens: int = 64, k_values: list[int] = (), trees: list = (),
              repeats: int = 1, json_path: Path | None = None, batch_size: int = 1, seed: int = 0) -> dict:
    """Measure every system on every prompt, alternating systems within each repeat; print a table,
    optionally write JSON; returns the results. All bundles must share one target model."""
    if repeats < 1 or batch_size < 1:
        raise SpeccError("--repeats and --batch-size must be >= 1")
    targets = {m.bundle.manifest["models"]["target"] for m in models}
    if len(targets) > 1:
        raise SpeccError(f"bundles compare only against one shared target; these have {sorted(targets)}")
    systems = _systems(models, list(k_values), list(trees))
    common = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "seed": seed}
    for _, model, kw in systems:  # warm-up: first calls pay for allocation and kernel selection
        model.generate([items[0]["prompt"]], **{**common, "max_new_tokens": 4}, **kw)
    runs: dict[str, list] = {name: [] for name, _, _ in systems}
    for _ in range(repeats):
        for name, model, kw in systems:
            runs[name].append(_run_system(model, items, batch_size, **common, **kw))
    reference = runs[systems[0][0]][0]["tokens"]
    results = {"max_new_tokens": max_new_tokens, "prompts": len(items), "repeats": repeats, "batch_size": batch_size,
               "bundles": [str(m.bundle.path) for m in models], "systems": {}}
    base_tps, rows = None, []
    for name, _, _ in systems:
        median = sorted(runs[name], key=lambda r: r["summary"]["tokens_per_second"])[len(runs[name]) // 2]
        s = median["summary"]
        equal = sum(a == b for a, b in zip(median["tokens"], reference))
        base_tps = base_tps or s["tokens_per_second"]
        s["speedup_vs_target_only"] = s["tokens_per_second"] / base_tps
        s["outputs_equal_target_only"] = f"{equal}/{len(items)}"
        s["tokens_per_second_all_repeats"] = [r["summary"]["tokens_per_second"] for r in runs[name]]
        results["systems"][name] = {**s, "per_prompt": median["per_prompt"]}
        rows.append([name, s["tokens_per_second"], s["speedup_vs_target_only"], s["acceptance_rate"],
                     s["tokens_per_target_pass"], s["prefill_seconds"], s["draft_seconds"], s["target_seconds"],
                     s["host_seconds"], s["outputs_equal_target_only"]])
    print(table(["system", "tok/s", "speed-up", "acceptance", "tokens/pass", "prefill s", "draft s", "target s",
                 "host s", "equal"], rows))
    for name, _, _ in systems[1:]:
        pos = results["systems"][name]["acceptance_by_position"]
        print(f"{name}: acceptance by position " + " ".join(f"{a:.2f}" for a in pos if a is not None))
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(results, indent=2))
        print(f"results written to {json_path}")
    return results
