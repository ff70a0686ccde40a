"""`specc tune`: measure what a round costs and how often drafts are accepted, predict the speed-up
of every chain length k, pick the best, check the prediction against measured runs.

With per-token acceptance alpha, a round of k drafts yields on average
E(k) = (1 - alpha^(k+1)) / (1 - alpha) tokens (Leviathan et al. 2023, arXiv:2211.17192), and costs
k drafting steps plus one verify pass of k+1 tokens, against E(k) target decode steps without
speculation:

    S(k) = (1 - alpha^(k+1)) / ((1 - alpha) (k c_d / c_t + c_v(k) / c_t))

- c_t: one target decode step (1 token); c_v(k): one verify pass of k+1 tokens, measured for each
  k (on CPUs it grows with k); c_d: one draft step (model, quantised and early-exit drafters).
  Each is the median time of the bundle's own target passes (`Target.decide`) and drafting
  steps (`Drafter.probe`) at batch 1, on a KV cache holding a real prompt, the calls of all
  kinds interleaved. Host work per round (acceptance outside the graph, KV commits, Python) is
  not in the model; the measured check shows it.
- alpha: accepted / (accepted + rejected) over a speculative run on the prompts at k = k_max,
  where a round of k drafts contributes its accepted drafts and, if it stopped early, one
  rejection (`per_token_acceptance` in the runtime statistics).
- prompt lookup has no draft model: a round costs one n-gram lookup (measured, ~0) and the
  lookup finds a continuation in a fraction h of rounds; a round without one is a plain decode
  step, so S(k) = (h E(k) + 1 - h) / ((lookup + h c_v(k) + (1 - h) c_t) / c_t).
"""
from __future__ import annotations

import json
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from ..errors import SpeccError
from ..limits import MAX_K
from ..speculation.speedup import expected_tokens


@dataclass
class Costs:
    """Median seconds of one engine call of each kind."""

    target_step: float  # c_t
    verify: dict[int, float]  # c_v(k), k -> seconds
    draft_step: float | None  # c_d (drafters with a step graph)
    lookup: float | None  # one prompt-lookup round (prompt_lookup drafters)

    def draft_round(self, k: int) -> float:
        """Drafting cost of one round of k tokens."""
        return self.lookup if self.lookup is not None else k * self.draft_step


def round_tokens(alpha: float, k: int, hit_rate: float = 1.0) -> float:
    """Mean tokens per target pass; a round without a draft (prompt lookup found nothing) yields 1."""
    return hit_rate * expected_tokens(alpha, k) + (1 - hit_rate)


def round_cost(k: int, costs: Costs, hit_rate: float = 1.0) -> float:
    """Mean cost of a round in units of c_t: drafting, then a verify pass or (no draft) a decode step."""
    return (costs.draft_round(k) + hit_rate * costs.verify[k] + (1 - hit_rate) * costs.target_step) / costs.target_step


def predicted_speedup(alpha: float, k: int, costs: Costs, hit_rate: float = 1.0) -> float:
    """S(k) of the module docstring; hit_rate < 1 only for prompt lookup."""
    return round_tokens(alpha, k, hit_rate) / round_cost(k, costs, hit_rate)


def _timed(fn, samples: list[float], keep: bool = True) -> None:
    """Call fn once; append its wall time to samples if keep."""
    start = time.perf_counter()
    fn()
    if keep:
        samples.append(time.perf_counter() - start)


def measure_costs(model, prompts: list[list[int]], k_max: int, repeats: int = 5) -> Costs:
    """Time c_t, c_v(1..k_max) and the drafting cost on each prompt's KV cache (batch 1, greedy).

    Each prompt is prefilled by the scheduler as a generation would be (target and drafter); the
    target passes are `Target.decide` calls, the drafting cost the drafter's own `probe`.
    """
    from ..runtime.drafters import Proposal
    from ..runtime.scheduler import Scheduler
    from ..speculation.sampling import SamplingParams

    device = model.device
    target_s: list[float] = []
    verify_s: dict[int, list[float]] = {k: [] for k in range(1, k_max + 1)}
    draft_s: list[float] = []
    drafter = model.drafter
    scheduler = Scheduler(model, k=k_max, stop_below=0.0)  # acceptance of every position, as tune models it
    for i, prompt in enumerate(prompts):
        n = len(prompt)
        if n + k_max + 2 > model.max_context:
            raise SpeccError(f"a prompt of {n} tokens + k_max {k_max} exceeds the bundle's max_context {model.max_context}")
        request = model.new_request(i, prompt, 1, SamplingParams(), 0, k=k_max)
        batch, first_token = scheduler.prefill([request])
        request.out = first_token[0]
        cache, params = batch.cache, batch.params
        cache.ensure(n + k_max + 2)
        # the tokens fed below only need the right shapes: cost does not depend on their values
        feed = torch.tensor([prompt[-1:] * (k_max + 1)], dtype=torch.long, device=device)
        zero = torch.zeros(1, device=device)
        first = torch.zeros(1, 1, dtype=torch.long, device=device)

        def verify(k: int):
            drafts = Proposal(feed[:, 1:k + 1], None, torch.tensor([k], device=device), drafter.kind)
            rows = torch.arange(k + 1, device=device)[None]
            return model.target.decide(cache, feed[:, :k + 1], rows, params, zero, drafts, torch.zeros(1, k, device=device))

        probe = drafter.probe(batch, k_max)
        for r in range(repeats + 1):  # round 0 warms this cache's shapes up and is not kept
            _timed(lambda: model.target.decide(cache, feed[:, :1], first, params, zero), target_s, r > 0)
            for k in verify_s:
                _timed(lambda: verify(k), verify_s[k], r > 0)
            _timed(probe, draft_s, r > 0)
    lookup = drafter.cost == "lookup"
    med = statistics.median
    return Costs(med(target_s), {k: med(v) for k, v in verify_s.items()},
                 None if lookup else med(draft_s), med(draft_s) if lookup else None)


def check_bundle(model) -> None:
    if not model.can_speculate:
        raise SpeccError(f"bundle {model.bundle.path} has no drafter (draft.method none): nothing to tune")
    if model.lookup_first:
        raise SpeccError("specc tune models one drafter; this bundle drafts by prompt lookup first, then its model "
                         "(draft.lookup): tune the same recipe without draft.lookup, or compare k with `specc bench --k`")
    if model.tree is not None:
        raise SpeccError("specc tune picks the chain length speculation.k; this bundle is compiled for "
                         "speculation.mode tree (compare tree shapes with `specc bench --tree`)")


def run_tune(model, items: list[dict], k_max: int = 8, max_new_tokens: int = 64, repeats: int = 3,
             timing_prompts: int = 4, check_k: list[int] | None = None) -> dict:
    """Measure, predict, pick k, check; returns the results (printed by `format_tune`)."""
    from .run import SpeccSystem, encode_prompts, median_run

    check_bundle(model)
    if not 1 <= k_max <= MAX_K:
        raise SpeccError(f"--k-max must be in [1, {MAX_K}], got {k_max}")
    if repeats < 1 or timing_prompts < 1:
        raise SpeccError("--repeats and --timing-prompts must be >= 1")
    if check_k and not all(1 <= k <= k_max for k in check_k):
        raise SpeccError(f"--check-k values must be in [1, --k-max {k_max}], got {sorted(check_k)}")
    prompts = encode_prompts(model, items)
    model.generate(prompts[:1], max_new_tokens=4, temperature=0.0, k=k_max)  # warm-up
    costs = measure_costs(model, prompts[:timing_prompts], k_max, repeats=max(5, repeats))

    model.generate(prompts, max_new_tokens=max_new_tokens, temperature=0.0, k=k_max)
    run = model.last_stats.speculation
    if run.accepted + run.rejected == 0:
        raise SpeccError("the speculative run judged no drafts (prompt lookup found nothing?): cannot estimate "
                         "acceptance; use longer or more repetitive prompts")
    alpha = run.accepted / (run.accepted + run.rejected)
    hit_rate = (run.drafted_at[0] / run.rounds) if costs.lookup is not None else 1.0
    predictions = {k: predicted_speedup(alpha, k, costs, hit_rate) for k in range(1, k_max + 1)}
    best = max(predictions, key=predictions.get)

    ks = sorted(set(check_k) if check_k else {k for k in (1, best - 1, best, best + 1, model.k) if k != "auto" and 1 <= k <= k_max})
    systems = [SpeccSystem("target-only", model, {"speculative": False})]
    systems += [SpeccSystem(f"k={k}", model, {"speculative": True, "k": k}) for k in ks]
    runs: dict[str, list] = {s.name: [] for s in systems}
    for _ in range(repeats):
        for s in systems:
            runs[s.name].append(s.run(prompts, max_new_tokens))
    base = median_run(runs["target-only"])["summary"]
    measured = {}
    for k in ks:
        r = median_run(runs[f"k={k}"])["summary"]
        measured[k] = {
            "speedup": r["tokens_per_second"] / base["tokens_per_second"], "tokens_per_second": r["tokens_per_second"],
            "per_token_acceptance": r["per_token_acceptance"], "tokens_per_target_pass": r["tokens_per_target_pass"],
            "engine_seconds_per_round": (r["target_seconds"] + r["draft_seconds"]) / r["rounds"] if r["rounds"] else None,
            "host_seconds_per_round": r["host_seconds"] / r["rounds"] if r["rounds"] else None,
        }
    return {
        "bundle": str(model.bundle.path), "draft_method": model.draft_method, "prompts": len(items),
        "max_new_tokens": max_new_tokens, "repeats": repeats, "k_max": k_max, "recipe_k": model.k,
        "costs": {"target_step": costs.target_step, "verify": costs.verify, "draft_step": costs.draft_step,
                  "lookup": costs.lookup},
        "alpha": alpha, "alpha_measured_at_k": k_max, "lookup_hit_rate": hit_rate if costs.lookup is not None else None,
        "target_only_tokens_per_second": base["tokens_per_second"],
        "predicted_speedup": predictions,
        "expected_tokens_per_round": {k: round_tokens(alpha, k, hit_rate) for k in predictions},
        "expected_cost_per_round": {k: round_cost(k, costs, hit_rate) for k in predictions},
        "best_k": best, "measured": measured,
    }


def format_tune(result: dict) -> str:
    from .table import table

    c = result["costs"]
    c_t = c["target_step"]
    lines = [f"c_t (target decode step) {c_t * 1e3:.3f} ms"]
    if c["draft_step"] is not None:
        lines.append(f"c_d (draft step) {c['draft_step'] * 1e3:.3f} ms = {c['draft_step'] / c_t:.3f} c_t")
    else:
        lines.append(f"prompt lookup {c['lookup'] * 1e3:.3f} ms a round, continuation found in "
                     f"{result['lookup_hit_rate']:.0%} of rounds")
    lines.append(f"alpha (per-token acceptance, run at k={result['alpha_measured_at_k']}) {result['alpha']:.3f}")
    rows = []
    for k, pred in result["predicted_speedup"].items():
        m = result["measured"].get(k, {})
        draft = (c["draft_step"] * k if c["draft_step"] is not None else c["lookup"]) / c_t
        engine = m.get("engine_seconds_per_round")
        host = m.get("host_seconds_per_round")
        rows.append([("* " if k == result["best_k"] else "") + str(k), c["verify"][k] / c_t, draft,
                     result["expected_tokens_per_round"][k], m.get("tokens_per_target_pass"),
                     result["expected_cost_per_round"][k],
                     engine / c_t if engine is not None else None, host * 1e3 if host is not None else None, pred,
                     m.get("speedup")])
    lines.append(table(["k", "c_v(k)/c_t", "draft/c_t", "tokens/round pred.", "meas.", "cost/round pred. (c_t)", "meas.",
                        "host ms/round", "speed-up pred.", "meas."], rows))
    lines.append("pred.: from the timed engine calls and alpha; meas.: median of the alternated runs (cost: draft + "
                 "target seconds per round, incl. acceptance; host: the rest)")
    best = result["best_k"]
    verdict = "" if result["predicted_speedup"][best] > 1 else (
        " (predicted slower than target-only at every k: this drafter does not pay on this machine)")
    lines.append(f"best k = {best}: predicted speed-up {result['predicted_speedup'][best]:.2f}x{verdict}")
    return "\n".join(lines)


def check_recipe_matches(path: Path, model) -> None:
    """Refuse to write into a recipe that did not produce this bundle's target and drafter."""
    from ..recipe import load_recipe

    recipe = load_recipe(path)
    manifest = model.bundle.manifest
    if recipe.target.model != manifest.models["target"] or recipe.draft.method != manifest.draft.method:
        raise SpeccError(f"recipe {path} has target {recipe.target.model!r} with draft.method {recipe.draft.method!r}; "
                         f"the bundle was compiled from {manifest.models['target']!r} with {manifest.draft.method!r}")


def set_speculation_k(path: Path, k: int) -> int:
    """Set speculation.k in a recipe YAML file, keeping its comments and layout; returns the old value.

    The edited text is validated: it must parse to the same recipe with only speculation.k changed.
    """
    from ..recipe import parse_recipe

    path = Path(path)
    text = path.read_text()
    before = parse_recipe(yaml.safe_load(text), str(path))
    edited = _edit_k(text, k)
    try:
        after = parse_recipe(yaml.safe_load(edited), str(path))
    except (yaml.YAMLError, SpeccError) as exc:
        raise SpeccError(f"could not edit {path} ({exc}); set speculation.k: {k} by hand") from None
    want = before.to_dict()
    want["speculation"]["k"] = k
    if after.to_dict() != want:
        raise SpeccError(f"could not edit {path} safely; set speculation.k: {k} by hand")
    path.write_text(edited)
    return before.speculation.k


_BLOCK = re.compile(r"^speculation:[ \t]*(#.*)?$", re.M)
_FLOW = re.compile(r"^(speculation:[ \t]*\{)([^}\n]*)(\}.*)$", re.M)


def _edit_k(text: str, k: int) -> str:
    if m := _FLOW.search(text):
        inner = m.group(2)
        if re.search(r"(^|,)\s*k\s*:", inner):
            inner = re.sub(r"((?:^|,)\s*k\s*:\s*)[^,]*?(\s*(?:,|$))", rf"\g<1>{k}\g<2>", inner, count=1)
        else:
            inner = inner.rstrip() + (", " if inner.strip() else "") + f"k: {k}"
        return text[:m.start()] + m.group(1) + inner + m.group(3) + text[m.end():]
    if m := _BLOCK.search(text):
        body_start = m.end() + 1
        lines = text[body_start:].split("\n")
        end = next((i for i, line in enumerate(lines) if line.strip() and not line[0].isspace() and not line.startswith("#")),
                   len(lines))
        block = lines[:end]
        for i, line in enumerate(block):
            if km := re.match(r"^(\s+k\s*:\s*)([^#\s]+)(.*)$", line):
                block[i] = f"{km.group(1)}{k}{km.group(3)}"
                break
        else:
            indent = next((re.match(r"^\s+", line).group(0) for line in block if line.strip() and line[0].isspace()), "  ")
            block.insert(0, f"{indent}k: {k}")
        return text[:body_start] + "\n".join(block + lines[end:])
    return text.rstrip("\n") + f"\nspeculation:\n  k: {k}\n"


def write_json(result: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))

