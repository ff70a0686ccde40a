"""`specc bench`: specc beside the baselines, on the same prompts and weights, in one run.

Every system gets the same prompt token ids (encoded once with the bundle's tokenizer; chat
prompts through its chat template), greedy decoding and the same max_new_tokens. Systems take
turns prompt by prompt (a batch of prompts at a time) within each repeat, so that a machine whose
speed drifts during the run (a shared VM) slows all of them alike; the median repeat (by
aggregate tokens/s) is reported. Every output is compared token for token with the reference,
system (1): `hf target-only` with `--compare hf` (bench_hf.py), else `specc target-only`.
"""
from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from ..errors import SpeccError
from ..hardware import cpu
from ..limits import is_probability
from ..onnx_passes import NUMERIC_FORMS
from ..prompts import warmup_items

SPECC_TARGET_ONLY = "specc target-only"


def read_prompts(path: Path, default_chat: bool = False, per_kind: int | None = None) -> list[dict]:
    """JSON lines ({"prompt": str, "chat": bool?, "kind": str?}) or plain text, one prompt per line
    (in plain lines the escapes \\n, \\t and \\\\ stand for a newline, a tab and a backslash). Lines in
    Spec-Bench's and MT-Bench's question format ({"category": str, "turns": [str, ...]}) are chat prompts of their
    first turn, of kind `category`. per_kind: keep the first N prompts of each kind (a sample per category)."""
    path = Path(path)
    if not path.is_file():
        raise SpeccError(f"prompts file {path} {'is a directory' if path.is_dir() else 'does not exist'}; allowed "
                         "a file of JSON lines or one prompt per line")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpeccError(f"prompts file {path} is not UTF-8 text (byte {exc.start}); give JSON lines or plain text") from None
    except OSError as exc:
        raise SpeccError(f"cannot read prompts file {path}: {exc.strerror or exc}") from None
    items = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                obj = json.loads(line)
            except (json.JSONDecodeError, RecursionError) as exc:
                raise SpeccError(f"{path}:{n}: not valid JSON ({str(exc)[:120]})") from None
            if isinstance(obj, dict) and "turns" in obj and "prompt" not in obj:
                items.append(_question(obj, path, n))
                continue
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"]:
                raise SpeccError(f"{path}:{n}: needs a non-empty string field \"prompt\" (or Spec-Bench's \"turns\")")
            chat, kind = obj.get("chat", default_chat), obj.get("kind", "")
            if not isinstance(chat, bool):
                raise SpeccError(f"{path}:{n}: field \"chat\" must be true or false, got {chat!r}")
            if not isinstance(kind, str):
                raise SpeccError(f"{path}:{n}: field \"kind\" must be a string, got {kind!r}")
            items.append({"prompt": obj["prompt"], "chat": chat, "kind": kind})
        else:
            items.append({"prompt": _unescape(line), "chat": default_chat, "kind": ""})
    if not items:
        raise SpeccError(f"prompts file {path} holds no prompts")
    if per_kind is not None:
        kept, seen = [], {}
        for it in items:
            seen[it["kind"]] = seen.get(it["kind"], 0) + 1
            if seen[it["kind"]] <= per_kind:
                kept.append(it)
        items = kept
    return items


def _question(obj: dict, path: Path, n: int) -> dict:
    """A Spec-Bench / MT-Bench question line as a prompt: its first turn, through the chat template."""
    turns, category = obj.get("turns"), obj.get("category", "")
    if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0]:
        raise SpeccError(f"{path}:{n}: field \"turns\" must be a list starting with a non-empty string")
    if not isinstance(category, str):
        raise SpeccError(f"{path}:{n}: field \"category\" must be a string, got {category!r}")
    return {"prompt": turns[0], "chat": True, "kind": category}


def _unescape(line: str) -> str:
    return re.sub(r"\\([nt\\])", lambda m: {"n": "\n", "t": "\t", "\\": "\\"}[m.group(1)], line)


def load_bundles(paths: list[Path], verify: bool = True, trust_code: bool = False, expect_id: str | None = None) -> list:
    """Load bundles; graphs that are byte-identical across them (one target compiled into several
    bundles) are loaded once and shared, so comparing drafters costs one copy of the target."""
    from ..bundle import open_bundle
    from ..runtime.graphs import open_runner
    from ..runtime.model import SpecModel

    engines: dict[tuple, object] = {}

    def open_graph(bundle, role: str):
        entry, recipe = bundle.graph(role), bundle.recipe
        files = tuple(bundle.manifest.files[f"{entry.dir}/{f}"].sha256 for f in entry.files)
        key = (bundle.manifest.backend, recipe.precision, recipe.device, entry.quantize,
               entry.entry, files, tuple(i.name for i in entry.inputs), tuple(entry.outputs))
        if key not in engines:
            engines[key] = open_runner(bundle, role)
        return engines[key]

    return [SpecModel(open_bundle(path, verify=verify, expect_id=expect_id, trust_code=trust_code), open_graph=open_graph)
            for path in paths]


def encode_prompts(model, items: list[dict]) -> list[list[int]]:
    """Token ids of every prompt, as `SpecModel.encode` makes them (chat template for chat prompts)."""
    return [model.encode([it["prompt"]], chat=it["chat"])[0] for it in items]


@dataclass
class SpeccSystem:
    """A bundle generating with one speculation setting (or none: the same compiled target alone)."""

    name: str
    model: object  # SpecModel
    kwargs: dict  # generate() keyword arguments: speculative, k, tree, seed
    batch_size: int = 1
    settings: dict = field(default_factory=dict)
    family: str = "specc"
    reference: str | None = None  # the system whose outputs this one must equal (None: the run's first)

    @property
    def speculative(self) -> bool:
        return self.kwargs["speculative"]

    @property
    def adaptive(self) -> bool:
        """k "auto": its policy learns from every call, so it is warmed up before it is timed."""
        return self.speculative and "tree" not in self.kwargs and self.kwargs.get("k", self.model.k) == "auto"

    def begin(self) -> None:
        """Called before each repeat's first prompt."""
        if self.speculative and getattr(self.model, "suffix_cache", None) is not None:
            # every repeat starts from the same cache (the --warm texts): outputs of these very prompts, from an
            # earlier repeat or another system on the same bundle, would be drafts no real traffic offers
            self.model.suffix_cache.reset()

    def run(self, prompts: list[list[int]], max_new_tokens: int) -> dict:
        """Generate every prompt, batch_size at a time; token ids, per-prompt figures and the aggregate (`stats`,
        the RunStats that `join_runs` adds up)."""
        from ..runtime.stats import RunStats

        tokens, per_prompt, total = [None] * len(prompts), [], RunStats()
        for lo in range(0, len(prompts), self.batch_size):
            done = self.model.generate(prompts[lo:lo + self.batch_size], max_new_tokens=max_new_tokens,
                                       temperature=0.0, **self.kwargs)
            call = self.model.last_stats
            for c in done:
                tokens[lo + c.index] = c.token_ids
                seconds = call.seconds if self.batch_size == 1 else None  # a batch's time is not one prompt's
                per_prompt.append({"prompt": lo + c.index, "new_tokens": len(c.token_ids),
                                   "finish_reason": c.finish_reason, "seconds": seconds,
                                   "tokens_per_second": len(c.token_ids) / seconds if seconds else None, **c.stats})
            total.merge(call)
        return {"summary": total.to_dict(), "tokens": tokens, "per_prompt": sorted(per_prompt, key=lambda p: p["prompt"]),
                "stats": total}


def target_build(manifest) -> str:
    """How a bundle's target was compiled: what its target-only output depends on beside the weights.

    That includes how its quantised graph computes attention: a chain graph on specc's CacheAttention kernel and a
    tree graph attending in float64 sum in other orders, and int8 activations turn those last bits into different
    near-ties, so each form is a build of its own."""
    t = manifest.recipe.target
    blocks = {"int8-gemm": "", "int4-gemm": f" gguf_blocks {t.gguf_blocks}"}.get(
        t.quantize, f" block {t.block_size} acc {t.accuracy_level} gguf_blocks {t.gguf_blocks}")
    quant = (f"{t.quantize}{blocks}"
             + (f" requantize {','.join(t.gguf_requantize)}" if t.gguf_requantize else "")
             + (f" float {','.join(t.keep_float)}" if t.keep_float else "")) if t.quantize else "unquantised"
    graph = manifest.graph("target")
    rewritten = (graph.facts.get("weight_quant") or {}) if graph is not None else {}
    forms = "".join(f" {form} {rewritten[form]}" for form in NUMERIC_FORMS if rewritten.get(form))
    return f"{manifest.backend} {manifest.recipe.precision} {t.dtype} {quant}{forms}"



def specc_systems(models: list, k_values: list[int | str], trees: list, batch_size: int = 1, seed: int = 0,
                  stop_below: list[float] = ()) -> list[SpeccSystem]:
    """Target-only on the first bundle's target, then every speculative variant asked for, per bundle.

    A bundle whose target was compiled differently (another quantisation, backend or precision: other
    target-only outputs) gets a target-only system of its own, which its speculative systems must equal.
    stop_below: each integer-k chain of a drafter that can end chains early (a draft model, an EAGLE head)
    is measured at each of these draft.stop_below thresholds instead of the recipe's."""
    common = {"seed": seed}
    builds = [target_build(m.bundle.manifest) for m in models]
    own: dict[str, str] = {}  # target build -> name of its target-only system
    systems = []
    for model, build in zip(models, builds):
        if build not in own:
            own[build] = SPECC_TARGET_ONLY if not own else f"{SPECC_TARGET_ONLY} [{model.bundle.path.name}]"
            settings = {"bundle": str(model.bundle.path), "backend": model.bundle.manifest.backend, "target": build}
            if (model.min_pass_rows or 1) > 1:
                settings["note"] = (f"1-token passes run as {model.min_pass_rows} rows: this CPU's kernels give a row "
                                    "other bits in 1-row passes than in verify passes (docs/quantization.md)")
            systems.append(SpeccSystem(own[build], model, {"speculative": False, **common}, batch_size, settings,
                                       reference=_own_reference(own[build])))
    for model, build in zip(models, builds):
        if not model.can_speculate:
            continue
        name = model.bundle.path.name
        variants = [(f"chain k={k}", {"k": k}, {"k": k}) for k in k_values]
        if model.drafter.method.tree_only:  # lookahead: k auto gates its own tree; a tree asked for runs it always
            variants = [(f"{model.tree.label} k=auto", {"k": "auto"}, {"k": "auto"})] if "auto" in k_values else []
            variants += [(f"{model.tree.label} every round", {"tree": model.tree}, {"tree": model.tree.label})] if trees else []
        elif model.target.step.has_tree_mask and model.drafter.method.trees:
            variants += [(t.label, {"tree": t}, {"tree": t.label}) for t in trees]
        if not variants:
            label = model.tree.label if model.tree else f"chain k={model.k}"
            variants = [(label, {}, {"tree": model.tree.label} if model.tree else {"k": model.k})]
        if stop_below and model.drafter.method.stops:
            variants = [v for label, kw, shape in variants for v in _with_stops(label, kw, shape, model, stop_below)]
        for label, kw, shape in variants:
            settings = {"bundle": str(model.bundle.path), "backend": model.bundle.manifest.backend,
                        "draft_method": model.draft_label, **shape}
            if model.min_pass_rows is None:
                settings["note"] = ("the target's kernels compute a row differently in passes of different sizes "
                                    "on this CPU: near-ties can differ from target-only (docs/quantization.md)")
            systems.append(SpeccSystem(f"{name} [{model.draft_label}] {label}", model,
                                       {"speculative": True, **common, **kw}, batch_size, settings,
                                       reference=_own_reference(own[build])))
    return systems


def _with_stops(label: str, kw: dict, shape: dict, model, stop_below: list[float]) -> list[tuple[str, dict, dict]]:
    """A chain of integer k once per stop_below threshold; trees and k auto (its policy sets its own
    threshold) as they are."""
    tree = "tree" in kw or (not kw and model.tree)  # asked for, or the recipe's speculation
    k = kw.get("k", model.k)
    if tree or k == "auto":
        return [(label, kw, shape)]
    return [(f"{label} stop<{p:g}", {**kw, "k": k, "stop_below": p}, {**shape, "k": k, "stop_below": p})
            for p in stop_below]


def _own_reference(target_only: str) -> str | None:
    """The reference of systems on a target build: None (the run's first system) for the first build,
    else that build's own target-only system."""
    return None if target_only == SPECC_TARGET_ONLY else target_only


def compare_tokens(tokens: list[int], reference: list[int]) -> tuple[str, int | None]:
    """("equal", None), ("prefix", n) when one output is a strict prefix of the other (n: the shorter
    length; e.g. one system stopped earlier), or ("differs", index of the first different token)."""
    if tokens == reference:
        return "equal", None
    n = min(len(tokens), len(reference))
    first = next((i for i in range(n) if tokens[i] != reference[i]), None)
    return ("prefix", n) if first is None else ("differs", first)


def median_run(runs: list[dict]) -> dict:
    """The repeat with the median aggregate tokens/s."""
    return sorted(runs, key=lambda r: r["summary"]["tokens_per_second"] or 0.0)[len(runs) // 2]


def summarise(systems: list, runs: dict[str, list[dict]], items: list[dict]) -> dict[str, dict]:
    """Per system: the median repeat's figures, equality with systems[0] per prompt, speed-ups."""
    base = median_run(runs[systems[0].name])["summary"]["tokens_per_second"]
    out = {}
    for s in systems:
        reference = median_run(runs[getattr(s, "reference", None) or systems[0].name])  # llama.cpp: its own target-only
        med = median_run(runs[s.name])
        summary = dict(med["summary"])
        counts = {"equal": 0, "prefix": 0, "differs": 0}
        per_prompt = []
        for p, tokens in zip(med["per_prompt"], med["tokens"]):
            status, where = compare_tokens(tokens, reference["tokens"][p["prompt"]])
            counts[status] += 1
            entry = {**p, "kind": items[p["prompt"]]["kind"], "equality": status}
            if status != "equal":  # both outputs, so a difference can be inspected
                entry.update({"first_difference" if status == "differs" else "common_prefix": where, "tokens": tokens,
                              "reference_tokens": reference["tokens"][p["prompt"]]})
            per_prompt.append(entry)
        summary.update({
            "family": s.family,
            "speculative": s.speculative,
            "settings": s.settings,
            "speedup_vs_reference": summary["tokens_per_second"] / base if base and summary["tokens_per_second"] else None,
            "equality": {**counts, "of": len(items)},
            "equality_reference": getattr(s, "reference", None) or systems[0].name,
            "outputs_equal": f"{counts['equal']}/{len(items)}",
            "tokens_per_second_all_repeats": [r["summary"]["tokens_per_second"] for r in runs[s.name]],
            "tokens_per_second_by_kind": _by_kind(per_prompt),
            "per_prompt": per_prompt,
        })
        out[s.name] = summary
    best = max((n for n, r in out.items() if r["family"] == "hf" and r["speculative"]),
               key=lambda n: out[n]["tokens_per_second"] or 0.0, default=None)
    for r in out.values():
        tps, best_tps = r["tokens_per_second"], best and out[best]["tokens_per_second"]
        r["speedup_vs_best_hf_speculative"] = tps / best_tps if best_tps and tps else None
    return out


def _by_kind(per_prompt: list[dict]) -> dict[str, float] | None:
    """Tokens/s over the prompts of each kind (code, chat, ...), where per-prompt times exist."""
    if any(p["seconds"] is None for p in per_prompt):
        return None
    kinds: dict[str, list[float]] = {}
    for p in per_prompt:
        acc = kinds.setdefault(p["kind"] or "-", [0, 0.0])
        acc[0] += p["new_tokens"]
        acc[1] += p["seconds"]
    return {k: n / s if s else None for k, (n, s) in kinds.items()}


def check_bench_settings(repeats: int, batch_size: int, stop_below: list[float], compare: str | None) -> None:
    """Refuse settings run_bench cannot measure; cheap, so the command line calls it before loading bundles."""
    if repeats < 1:
        raise SpeccError(f"--repeats {repeats}: allowed an integer >= 1")
    if batch_size < 1:
        raise SpeccError(f"--max-batch {batch_size}: allowed an integer >= 1")
    if bad := [p for p in stop_below if not is_probability(p)]:
        raise SpeccError(f"--stop-below {bad[0]!r}: allowed a probability in [0, 1] (0: chains never end early)")
    if compare not in (None, "hf", "llamacpp"):
        raise SpeccError(f"--compare {compare!r}: allowed: hf (Hugging Face transformers), llamacpp (llama.cpp)")
    if compare and batch_size != 1:
        raise SpeccError(f"--compare {compare} measures batch 1 (the baselines take one prompt at a time); "
                         "drop --max-batch")


ADDED_UP = ("requests", "new_tokens", "seconds", "prefill_seconds", "draft_seconds", "target_seconds", "host_seconds")


def join_runs(parts: list[dict]) -> dict:
    """One run of a system from its runs on consecutive slices of the prompts: tokens and per-prompt figures in
    prompt order, the aggregate added up (a specc system's RunStats merged, so its rates are over the whole run)."""
    tokens, per_prompt = [], []
    for part in parts:
        per_prompt += [{**p, "prompt": p["prompt"] + len(tokens)} for p in part["per_prompt"]]
        tokens += part["tokens"]
    if all("stats" in part for part in parts):
        from ..runtime.stats import RunStats

        total = RunStats()
        for part in parts:
            total.merge(part["stats"])
        summary = total.to_dict()
    else:
        summary = dict(parts[0]["summary"])
        for key in ADDED_UP:
            values = [part["summary"].get(key) for part in parts]
            summary[key] = None if None in values else sum(values)
        summary["tokens_per_second"] = summary["new_tokens"] / summary["seconds"] if summary["seconds"] else None
    return {"summary": summary, "tokens": tokens, "per_prompt": per_prompt}


def measure(systems: list, model, prompts: list[list[int]], max_new_tokens: int, repeats: int,
            progress: bool, batch_size: int = 1) -> dict[str, list]:
    """Warm every system up, then run each on every prompt `repeats` times, the systems taking turns batch by
    batch (batch_size prompts) within each repeat; each system's runs by name. model: the first bundle's (it
    encodes the warm-up prompts)."""
    for s in systems:  # warm-up: first calls pay for allocation and kernel selection
        s.run(prompts[:1], 4)
    fits = min(map(len, prompts))  # a prompt this long fits the bundles at this budget: warm-up prompts keep their ends
    warmup = [p[-fits:] for p in encode_prompts(model, warmup_items())]
    for s in systems:  # and k auto learns its costs and acceptance on other prompts, as a running server has
        if getattr(s, "adaptive", False):
            s.run(warmup, max_new_tokens)
    batches = -(-len(prompts) // batch_size)
    with tqdm(total=repeats * batches, desc="bench", unit="batch", file=sys.stderr, disable=not progress) as bar:
        return take_turns(systems, prompts, max_new_tokens, repeats, batch_size, bar.update)


def take_turns(systems: list, prompts: list[list[int]], max_new_tokens: int, repeats: int, batch_size: int = 1,
               done: Callable[[], object] = lambda: None) -> dict[str, list]:
    """Each system's `repeats` runs over every prompt, by name; the systems take turns batch by batch (batch_size
    prompts), and `done` is called after each batch that every system has run."""
    runs: dict[str, list] = {s.name: [] for s in systems}
    slices = [prompts[lo:lo + batch_size] for lo in range(0, len(prompts), batch_size)]
    for _ in range(repeats):
        parts: dict[str, list] = {s.name: [] for s in systems}
        for s in systems:
            getattr(s, "begin", lambda: None)()
        for piece in slices:
            for s in systems:
                parts[s.name].append(s.run(piece, max_new_tokens))
            done()
        for s in systems:
            runs[s.name].append(join_runs(parts[s.name]))
    return runs


def run_bench(models: list, items: list[dict], max_new_tokens: int = 64, k_values: list[int | str] = (), trees: list = (),
              repeats: int = 1, json_path: Path | None = None, batch_size: int = 1, seed: int = 0,
              compare: str | None = None, progress: bool = True, llamacpp: dict | None = None,
              stop_below: list[float] = (), llamacpp_servers: list[str] = ()) -> dict:
    """Measure every system on every prompt, the systems taking turns batch by batch; print a table,
    optionally write JSON (plus a Markdown table and a PNG beside it); returns the results.

    All bundles must share one target model. compare="hf" adds the Hugging Face systems of
    bench_hf.py (same weights, loaded from the bundle's recorded model source) and makes
    `hf target-only` the reference. compare="llamacpp" adds llama.cpp target-only and speculative
    (bench/llamacpp.py; `llamacpp` holds target_gguf, draft_gguf, threads) after specc's systems,
    with a bandwidth line per target. llamacpp_servers: running llama-servers (`[LABEL=]URL`,
    bench/llamacpp_server.py), one system each, after those. progress: a bar on stderr, one step per batch of
    prompts that every system has run. stop_below: draft.stop_below thresholds to measure each chain at (`specc_systems`).
    """
    from .report import summary_table, write_outputs

    check_bench_settings(repeats, batch_size, stop_below, compare)
    targets = {m.bundle.manifest.models["target"] for m in models}
    if len(targets) > 1:
        raise SpeccError(f"bundles compare only against one shared target; these have {sorted(targets)}")
    prompts = encode_prompts(models[0], items)
    systems, skipped = [], []
    # the anchors' draft lengths: the integer k asked for (k "auto" is specc's alone), else the recipes'
    anchor_k = [k for k in k_values if k != "auto"] or sorted({m.k for m in models if m.k != "auto"})
    if compare == "hf":
        from .hf import hf_systems

        systems, skipped = hf_systems(models, anchor_k, models[0].tokenizer)
    systems += specc_systems(models, list(k_values), list(trees), batch_size, seed, list(stop_below))
    if compare == "llamacpp":
        from .llamacpp import systems_for_bench

        systems += systems_for_bench(models, anchor_k, llamacpp or {}, prompts,
                                     max_new_tokens)
    if llamacpp_servers:
        from .llamacpp import LLAMACPP_TARGET_ONLY
        from .llamacpp_server import server_systems

        systems += server_systems(list(llamacpp_servers), sorted(models[0].eos_ids),
                                  LLAMACPP_TARGET_ONLY if compare == "llamacpp" else None)
    runs = measure(systems, models[0], prompts, max_new_tokens, repeats, progress, batch_size)
    results = {
        "reference": systems[0].name, "compare": compare, "max_new_tokens": max_new_tokens, "prompts": len(items),
        "prompt_kinds": {k: sum(it["kind"] == k for it in items) for k in sorted({it["kind"] for it in items})},
        "repeats": repeats, "batch_size": batch_size, "bundles": [str(m.bundle.path) for m in models],
        "target": next(iter(targets)), "systems": summarise(systems, runs, items), "skipped": skipped,
        "machine": cpu(),
    }
    if compare == "llamacpp" or llamacpp_servers:
        from .llamacpp import annotate
        from .llamacpp_server import LlamaServerSystem, server_target_gguf

        opts = llamacpp or {}
        if llamacpp_servers and not opts.get("resolved"):
            opts["resolved"] = {"target_gguf": server_target_gguf([s for s in systems if isinstance(s, LlamaServerSystem)])}
        annotate(results, models, opts)
    print(summary_table(results))
    for line in results.get("goal", []) + results.get("bandwidth_lines", []):
        print(line)
    for name, r in results["systems"].items():
        if r["speculative"] and r["acceptance_by_position"]:
            print(f"{name}: acceptance by position " + " ".join(f"{a:.2f}" for a in r["acceptance_by_position"] if a is not None))
    if json_path:
        for path in write_outputs(results, Path(json_path)):
            print(f"written: {path}")
    return results
