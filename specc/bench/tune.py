"""`specc tune`: measure what a round costs and how far chains of drafts get, predict the speed-up
of every chain length k, pick the best, check the prediction against measured runs.

A round of k drafts yields E(k) = 1 + s_1 + ... + s_k tokens on average, s_i being the fraction of
rounds whose first i drafts are all accepted, and costs k drafting steps plus one verify pass of
k+1 tokens, against E(k) target decode steps without speculation:

    S(k) = E(k) / (k c_d / c_t + c_v(k) / c_t)

With a per-token acceptance alpha the same at every position, s_i = alpha^i and E(k) is the
geometric (1 - alpha^(k+1)) / (1 - alpha) of Leviathan et al. 2023 (arXiv:2211.17192); measured
survival needs no such assumption (acceptance is not the same along a chain: easy stretches of
text carry long chains, so alpha pooled over a run at k_max overstates the first positions).

- c_t: one target decode step (1 token); c_v(k): one verify pass of k+1 tokens, measured for each
  k (on CPUs it grows with k); c_d: one draft step (model, quantised and early-exit drafters).
  Each is the median time of the bundle's own target passes (`Verifier.next_token`, `Verifier.chain`) and drafting
  steps (`Drafter.probe`) at batch 1, on a KV cache holding a real prompt, the calls of all
  kinds interleaved. Host work per round (acceptance outside the graph, KV commits, Python) is
  not in the model; the measured check shows it.
- s_1..s_kmax: from a speculative run on the prompts at k = k_max with full chains: a round of k
  drafts accepts what the first k drafts of that run's round from the same context accepted (the
  drafter draws them one at a time), so the one run estimates E(k) for every k <= k_max. alpha
  (`per_token_acceptance` in the runtime statistics) is reported beside it.
- prompt lookup has no draft model: a round costs one n-gram lookup (measured, ~0) and the
  lookup finds a continuation in a fraction h of rounds (s_i over those rounds); a round without one
  is a plain decode step, so S(k) = (h E(k) + 1 - h) / ((lookup + h c_v(k) + (1 - h) c_t) / c_t).
- prompt lookup or the suffix drafter in front of a draft model (draft.lookup, draft.suffix): every
  round costs the lookup; a fraction h of rounds is drafted by the lookup (its own s_i, E_l), the
  rest by the model (E_m, k c_d), and every round is verified:
  S(k) = (h E_l(k) + (1 - h) E_m(k)) / ((lookup + (1 - h) k c_d + c_v(k)) / c_t).
- the model is of full chains: s_i, the costs and the checks run with draft.stop_below 0, and
  a bundle compiled with stop_below > 0 is also measured as compiled, beside them.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..errors import SpeccError
from ..limits import MAX_K, is_probability
from ..runtime.stats import RowStats


@dataclass
class Costs:
    """Median seconds of one engine call of each kind."""

    target_step: float  # c_t
    verify: dict[int, float]  # c_v(k), k -> seconds
    draft_step: float | None  # c_d (drafters with a step graph; the model behind prompt lookup)
    lookup: float | None  # one prompt-lookup round (prompt lookup, alone or in front of a model)


@dataclass
class Acceptance:
    """How far each way of drafting a round gets, and how often the drafter without a graph (prompt lookup,
    the suffix drafter) drafts the round.

    A survival curve [s_1, s_2, ...] gives, for each draft position i, the fraction of an arm's rounds
    whose first i drafts were all accepted (measured with full chains): a round of k drafts then yields
    E(k) = 1 + s_1 + ... + s_k tokens. alpha, the per-token acceptance, is what the geometric model
    would make of the same run (s_i = alpha^i); it is reported, not used."""

    model: list[float] | None  # survival of rounds a draft graph drafts (None: the drafter has no draft graph)
    lookup: list[float] | None = None  # survival of rounds prompt lookup or the suffix drafter drafts (None: neither)
    hit_rate: float = 0.0  # h: the fraction of rounds they draft
    alpha_model: float | None = None
    alpha_lookup: float | None = None

    @classmethod
    def of(cls, run, has_model: bool, has_lookup: bool) -> "Acceptance":
        """From a run's statistics (`RowStats`); an arm that never drafted gets an empty curve (its weight is 0)."""
        def arm(accepted_at: list[int], rounds: int, accepted: int, rejected: int) -> tuple[list[float], float]:
            survival = [a / rounds for a in accepted_at] if rounds else []
            return survival, accepted / (accepted + rejected) if accepted + rejected else 0.0

        if not has_lookup:
            survival, alpha = arm(run.accepted_at, run.rounds, run.accepted, run.rejected)
            return cls(survival, alpha_model=alpha)
        if not has_model:  # prompt lookup alone: rounds where it found nothing drafted nothing
            found = run.drafted_at[0] if run.drafted_at else 0
            survival, alpha = arm(run.accepted_at, found, run.accepted, run.rejected)
            return cls(None, survival, found / run.rounds if run.rounds else 0.0, alpha_lookup=alpha)
        front_at = run.front_accepted_at + [0] * (len(run.accepted_at) - len(run.front_accepted_at))
        model, alpha_m = arm([a - b for a, b in zip(run.accepted_at, front_at)], run.rounds - run.front_rounds,
                             run.accepted - run.front_accepted, run.rejected - run.front_rejected)
        lookup, alpha_l = arm(front_at, run.front_rounds, run.front_accepted, run.front_rejected)
        return cls(model, lookup, run.front_rounds / run.rounds if run.rounds else 0.0, alpha_m, alpha_l)


def chain_tokens(survival: list[float], k: int) -> float:
    """Mean tokens of a round of k drafts: 1 + s_1 + ... + s_k (positions the run never reached count 0)."""
    return 1.0 + sum(survival[:k])


def round_tokens(acc: Acceptance, k: int) -> float:
    """Mean tokens per target pass: lookup's rounds, then the model's (or plain decode steps: 1 token)."""
    h = acc.hit_rate if acc.lookup is not None else 0.0
    rest = chain_tokens(acc.model, k) if acc.model is not None else 1.0
    return (h * chain_tokens(acc.lookup, k) if h else 0.0) + (1 - h) * rest


def round_cost(k: int, costs: Costs, acc: Acceptance) -> float:
    """Mean cost of a round in units of c_t: the lookup (if any), the model's drafts in rounds lookup does
    not draft, then a verify pass (or, with nothing drafted, a decode step)."""
    h = acc.hit_rate if acc.lookup is not None else 0.0
    rest = k * costs.draft_step + costs.verify[k] if costs.draft_step is not None else costs.target_step
    return ((costs.lookup or 0.0) + h * costs.verify[k] + (1 - h) * rest) / costs.target_step


def predicted_speedup(acc: Acceptance, k: int, costs: Costs) -> float:
    """S(k) of the module docstring."""
    return round_tokens(acc, k) / round_cost(k, costs, acc)


def _timed(fn, samples: list[float], keep: bool = True) -> None:
    """Call fn once; append its wall time to samples if keep."""
    start = time.perf_counter()
    fn()
    if keep:
        samples.append(time.perf_counter() - start)


def measure_costs(model, prompts: list[list[int]], k_max: int, repeats: int = 5) -> Costs:
    """Time c_t, c_v(1..k_max) and the drafting cost on each prompt's KV cache (batch 1, greedy).

    Each prompt is prefilled by the scheduler as a generation would be (target and drafter); the
    target passes are the verifier's, the drafting costs the `probe` of each way the drafter
    drafts (`Drafter.arms`: a draft graph's step, a prompt lookup, or both for draft.lookup).
    """
    from ..runtime.drafters import Proposal
    from ..runtime.scheduler import Scheduler
    from ..speculation.sampling import SamplingParams

    device = model.device
    target_s: list[float] = []
    verify_s: dict[int, list[float]] = {k: [] for k in range(1, k_max + 1)}
    arms = list(model.drafter.arms.values())
    arm_s: list[list[float]] = [[] for _ in arms]
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
            drafts = Proposal(feed[:, 1:k + 1], None, torch.tensor([k], device=device))
            return model.verifier.chain(batch, drafts, params, torch.zeros(1, k, device=device), zero)

        probes = [arm.probe(batch, k_max) for arm in arms]
        for r in range(repeats + 1):  # round 0 warms this cache's shapes up and is not kept
            _timed(lambda: model.verifier.next_token(cache, feed[:, :1], first, params, zero), target_s, r > 0)
            for k in verify_s:
                _timed(lambda: verify(k), verify_s[k], r > 0)
            for probe, samples in zip(probes, arm_s):
                _timed(probe, samples, r > 0)
    med = statistics.median
    by_cost = {arm.method.cost: med(samples) for arm, samples in zip(arms, arm_s)}
    return Costs(med(target_s), {k: med(v) for k, v in verify_s.items()}, by_cost.get("step"), by_cost.get("lookup"))


def check_bundle(model) -> None:
    if not model.can_speculate:
        raise SpeccError(f"bundle {model.bundle.path} has no drafter (draft.method none): nothing to tune")
    if model.tree is not None:
        raise SpeccError("specc tune picks the chain length speculation.k; this bundle is compiled for "
                         "speculation.mode tree (compare tree shapes with `specc bench --tree`)")


def run_tune(model, items: list[dict], k_max: int = 8, max_new_tokens: int = 64, repeats: int = 3,
             timing_prompts: int = 4, check_k: list[int] | None = None, stop_below: list[float] = (),
             progress: bool = True) -> dict:
    """Measure, predict, pick k, check; returns the results (printed by `format_tune`).

    stop_below: draft.stop_below thresholds to measure at the best k beside its full chains (drafters of one
    token at a time); the fastest of them, or 0 if full chains win, is `best_stop_below`. progress: a bar on
    stderr, one step for the cost timings, one per prompt of the acceptance run, one per prompt every check ran.
    """
    from .run import encode_prompts, median_run, take_turns

    _check_tune_args(model, k_max, max_new_tokens, repeats, timing_prompts, check_k, stop_below)
    prompts = encode_prompts(model, items)
    full = {"temperature": 0.0, "stop_below": 0.0}  # full chains: what the model predicts
    with tqdm(total=1 + len(prompts), desc="tune", unit="step", file=sys.stderr, disable=not progress) as bar:
        bar.set_postfix_str("engine costs")
        model.generate(prompts[:1], max_new_tokens=4, k=k_max, **full)  # warm-up
        costs = measure_costs(model, prompts[:timing_prompts], k_max, repeats=max(5, repeats))
        bar.update()

        run = RowStats()
        bar.set_postfix_str(f"acceptance, chains of {k_max}")
        for prompt in prompts:  # batch 1, as the costs are timed (lookup drafts a batch's round only if every row finds)
            model.generate([prompt], max_new_tokens=max_new_tokens, k=k_max, **full)
            run.merge(model.last_stats.speculation)
            bar.update()
        if run.accepted + run.rejected == 0:
            raise SpeccError("the speculative run judged no drafts (prompt lookup found nothing?): cannot estimate "
                             "acceptance; use longer or more repetitive prompts")
        acc = Acceptance.of(run, costs.draft_step is not None, costs.lookup is not None)
        predictions = {k: predicted_speedup(acc, k, costs) for k in range(1, k_max + 1)}
        best = max(predictions, key=predictions.get)

        ks = sorted(set(check_k) if check_k else {k for k in (1, best - 1, best, best + 1, model.k)
                                                  if k != "auto" and 1 <= k <= k_max}
                    | ({best} if stop_below else set()))  # the stop thresholds compare with the best k's full chains
        systems, as_compiled, stops = _check_systems(model, ks, best, stop_below)
        bar.total += repeats * len(prompts)
        bar.set_postfix_str(f"check k={', '.join(map(str, ks))}")
        runs = take_turns(systems, prompts, max_new_tokens, repeats, done=bar.update)
    base = median_run(runs["target-only"])["summary"]
    if base["new_tokens"] <= base["requests"]:
        raise SpeccError("target-only decoding ended every prompt at its first token (end of sequence): nothing to "
                         "compare; use other prompts")

    def figures(name: str) -> dict:
        return _figures(median_run(runs[name])["summary"], base)

    measured_stops = {p: figures(f"k={best} stop<{p:g}") for p in stops}
    best_stop = max([0.0, *stops], key=lambda p: (measured_stops[p] if p else figures(f"k={best}"))["speedup"]) if stops else None
    return {
        "bundle": str(model.bundle.path), "draft_method": model.draft_method, "prompts": len(items),
        "max_new_tokens": max_new_tokens, "repeats": repeats, "k_max": k_max, "recipe_k": model.k,
        "costs": {"target_step": costs.target_step, "verify": costs.verify, "draft_step": costs.draft_step,
                  "lookup": costs.lookup},
        "alpha": acc.alpha_model if acc.model is not None else acc.alpha_lookup, "alpha_model": acc.alpha_model,
        "alpha_lookup": acc.alpha_lookup, "alpha_measured_at_k": k_max,
        "survival_model": acc.model, "survival_lookup": acc.lookup,
        "lookup_hit_rate": acc.hit_rate if acc.lookup is not None else None,
        "target_only_tokens_per_second": base["tokens_per_second"], "target_only_decode_tokens_per_second": decode_rate(base),
        "predicted_speedup": predictions,
        "expected_tokens_per_round": {k: round_tokens(acc, k) for k in predictions},
        "expected_cost_per_round": {k: round_cost(k, costs, acc) for k in predictions},
        "best_k": best, "measured": {k: figures(f"k={k}") for k in ks},
        "measured_as_compiled": ({"k": model.k, "stop_below": model.stop_below, **figures("as compiled")}
                                 if as_compiled else None),
        "measured_stop_below": measured_stops, "best_stop_below": best_stop,
    }


def _check_tune_args(model, k_max: int, max_new_tokens: int, repeats: int, timing_prompts: int,
                     check_k: list[int] | None, stop_below) -> None:
    """One SpeccError for the first setting of `run_tune` this bundle or its bounds refuse."""
    check_bundle(model)
    if not 1 <= k_max <= MAX_K:
        raise SpeccError(f"--k-max must be in [1, {MAX_K}], got {k_max}")
    if repeats < 1 or timing_prompts < 1:
        raise SpeccError("--repeats and --timing-prompts must be >= 1")
    if bad := [p for p in stop_below if not is_probability(p)]:
        raise SpeccError(f"--stop-below {bad[0]!r}: allowed a probability in [0, 1] (0: chains never end early)")
    if stop_below and not model.drafter.method.stops:
        raise SpeccError(f"--stop-below ends chains of drafters of one token at a time (a draft model, early exit, an "
                         f"EAGLE head); this bundle drafts with {model.draft_method}")
    if max_new_tokens < 2:
        raise SpeccError("--max-new-tokens must be >= 2 (tune measures decoding after prefill's first token), "
                         f"got {max_new_tokens}")
    if check_k and not all(1 <= k <= k_max for k in check_k):
        raise SpeccError(f"--check-k values must be in [1, --k-max {k_max}], got {sorted(check_k)}")


def _check_systems(model, ks: list[int], best: int, stop_below) -> tuple[list, bool, list[float]]:
    """What the check runs time: target-only, each k's full chains, the recipe's own chains where they stop
    early, and the best k at each stop threshold; also whether the recipe's ran, and the thresholds."""
    from .run import SpeccSystem

    systems = [SpeccSystem("target-only", model, {"speculative": False})]
    systems += [SpeccSystem(f"k={k}", model, {"speculative": True, "k": k, "stop_below": 0.0}) for k in ks]
    as_compiled = model.stop_below > 0 and model.drafter.method.stops and model.k != "auto" and model.tree is None
    if as_compiled:  # the recipe's own chains, which stop early: beside the full chains the model predicts
        systems.append(SpeccSystem("as compiled", model, {"speculative": True}))
    stops = sorted(set(float(p) for p in stop_below))
    systems += [SpeccSystem(f"k={best} stop<{p:g}", model, {"speculative": True, "k": best, "stop_below": p})
                for p in stops]
    return systems, as_compiled, stops


def _figures(r: dict, base: dict) -> dict:
    """A check run's summary against target-only's."""
    return {
        "speedup": decode_rate(r) / decode_rate(base), "decode_tokens_per_second": decode_rate(r),
        "end_to_end_speedup": r["tokens_per_second"] / base["tokens_per_second"], "tokens_per_second": r["tokens_per_second"],
        "per_token_acceptance": r["per_token_acceptance"], "tokens_per_target_pass": r["tokens_per_target_pass"],
        "engine_seconds_per_round": (r["target_seconds"] + r["draft_seconds"]) / r["rounds"] if r["rounds"] else None,
        "host_seconds_per_round": r["host_seconds"] / r["rounds"] if r["rounds"] else None,
    }

def decode_rate(summary: dict) -> float:
    """Tokens a second after prefill, what S(k) predicts: the first token of each prompt comes from the
    target's prefill; a draft model's own prefill (taken lazily, in its first round) stays in."""
    return (summary["new_tokens"] - summary["requests"]) / (summary["seconds"] - summary["prefill_seconds"])


def format_tune(result: dict) -> str:
    from .table import table

    c = result["costs"]
    c_t = c["target_step"]
    h = result["lookup_hit_rate"]
    lines = [f"c_t (target decode step) {c_t * 1e3:.3f} ms"]
    if c["draft_step"] is not None:
        lines.append(f"c_d (draft step) {c['draft_step'] * 1e3:.3f} ms = {c['draft_step'] / c_t:.3f} c_t")
    if c["lookup"] is not None:
        drafts = "drafts" if c["draft_step"] is not None else "finds a continuation in"
        lines.append(f"prompt lookup {c['lookup'] * 1e3:.3f} ms a round, {drafts} {h:.0%} of rounds")
    at = f"run at k={result['alpha_measured_at_k']}, full chains"
    arms = [(name, result[f"survival_{key}"], result[f"alpha_{key}"]) for name, key in
            (("model rounds", "model"), ("lookup rounds", "lookup")) if result[f"survival_{key}"] is not None]
    for name, survival, alpha in arms:
        label = f"{name} " if len(arms) > 1 else ""
        lines.append(f"{label}accepted through position 1..{len(survival)} ({at}): "
                     f"{' '.join(f'{x:.2f}' for x in survival)}; per-token alpha {alpha:.3f}")
    rows = []
    for k, pred in result["predicted_speedup"].items():
        m = result["measured"].get(k, {})
        draft = ((c["lookup"] or 0.0) + (1 - (h or 0.0)) * k * (c["draft_step"] or 0.0)) / c_t
        engine = m.get("engine_seconds_per_round")
        host = m.get("host_seconds_per_round")
        rows.append([("* " if k == result["best_k"] else "") + str(k), c["verify"][k] / c_t, draft,
                     result["expected_tokens_per_round"][k], m.get("tokens_per_target_pass"),
                     result["expected_cost_per_round"][k],
                     engine / c_t if engine is not None else None, host * 1e3 if host is not None else None, pred,
                     m.get("speedup")])
    lines.append(table(["k", "c_v(k)/c_t", "draft/c_t", "tokens/round pred.", "meas.", "cost/round pred. (c_t)", "meas.",
                        "host ms/round", "speed-up pred.", "meas."], rows))
    lines.append("pred.: from the timed engine calls and how far chains got; meas.: median of the alternated runs (cost: draft + "
                 "target seconds per round, incl. acceptance; host: the rest; speed-up: decode tokens/s after prefill)")
    if m := result["measured_as_compiled"]:
        lines.append(f"as compiled (k={m['k']}, chains stop after a draft below p={m['stop_below']:g}): "
                     f"{m['tokens_per_target_pass']:.2f} tokens/pass, measured speed-up {m['speedup']:.2f}x")
    best = result["best_k"]
    for p, m in result["measured_stop_below"].items():
        lines.append(f"k={best}, chains stop after a draft below p={p:g}: {m['tokens_per_target_pass']:.2f} tokens/pass, "
                     f"measured speed-up {m['speedup']:.2f}x (full chains {result['measured'][best]['speedup']:.2f}x)")
    if result["best_stop_below"] is not None:
        lines.append(f"best draft.stop_below at k={best}: {result['best_stop_below']:g} (measured)")
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


def write_json(result: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))

