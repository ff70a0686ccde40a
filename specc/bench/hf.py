"""Hugging Face baselines for `specc bench --compare hf`: the bundle's own weights through transformers.

Every system here is what a user would run instead of specc, on the same prompt token ids,
greedy, batch 1, the same max_new_tokens and the bundle's EOS ids:

- `hf target-only`: `model.generate`, the reference every output is compared with;
- `hf assisted [DRAFT] default`: `generate(assistant_model=DRAFT)` with the draft's own
  generation_config (transformers 5: up to 20 tokens a round, "constant" schedule, drafting stops
  early below confidence 0.4), i.e. what the library does unless told otherwise;
- `hf assisted [DRAFT] k=K`: `num_assistant_tokens=K`, `num_assistant_tokens_schedule="constant"`,
  `assistant_confidence_threshold=0` (exactly K drafts a round, as specc's chain k=K);
- `hf prompt lookup k=K`: `prompt_lookup_num_tokens=K`, `max_matching_ngram_size` from a
  prompt-lookup bundle's `draft.max_ngram` (else transformers' default, 2).

Which bundles get assisted systems (those whose draft graph is a separate model) and which the
prompt lookup system takes its n-gram size from are read from the method table (specc/methods.py).

The models' generation_config is replaced by a neutral one (EOS and pad ids only), so no
repetition penalty or sampling default from a model card applies; specc applies none either.
Acceptance of the speculative systems is recorded per round from the arguments transformers
passes to its candidate generator's `update_candidate_strategy(input_ids, scores, n_matches)`
(drafted = scores.shape[1] - 1, accepted = n_matches): a private hook, so a transformers
version without it reports no acceptance rather than a guess.
"""
from __future__ import annotations

import copy
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from ..methods import DraftMethod, get_method
from ..runtime.stats import RowStats

HF_TARGET_ONLY = "hf target-only"
# why transformers' assisted generation cannot load a bundle's drafter, by its draft graph (specc/methods.py);
# only a "model" graph is a separate model it could
NOT_ASSISTED = {
    "target": "the drafter is the target's own quantised copy compiled into the bundle, not a separate model",
    "exit": "the drafter is the target's first layers sharing its KV cache, not a separate model",
    "head": "the drafter is a learned head over the target's features, not a separate model",
    None: "no draft model",
}


@dataclass
class HFSystem:
    """One Hugging Face way of generating; `run` measures it on every prompt (batch 1)."""

    name: str
    model: torch.nn.Module
    eos_ids: list[int]
    kwargs: dict = field(default_factory=dict)  # generate() keyword arguments beyond the common ones
    assistant: torch.nn.Module | None = None
    assistant_config: object = None  # the assistant's generation_config during this system's calls
    settings: dict = field(default_factory=dict)  # what the table and JSON say about it
    family: str = "hf"

    @property
    def speculative(self) -> bool:
        return self.assistant is not None or "prompt_lookup_num_tokens" in self.kwargs

    def run(self, prompts: list[list[int]], max_new_tokens: int) -> dict:
        """Generate every prompt; token ids (EOS stripped), per-prompt figures and the aggregate."""
        tokens, per_prompt, total, seconds = [], [], RowStats(), 0.0
        for i, ids in enumerate(prompts):
            out, reason, took, stats = self.generate(ids, max_new_tokens)
            tokens.append(out)
            seconds += took
            total.merge(stats)
            per_prompt.append({"prompt": i, "new_tokens": len(out), "finish_reason": reason, "seconds": took,
                               "tokens_per_second": len(out) / took if took else None, **stats.to_dict()})
        new_tokens = sum(len(t) for t in tokens)
        summary = {"requests": len(prompts), "new_tokens": new_tokens, "seconds": seconds,
                   "tokens_per_second": new_tokens / seconds if seconds else None, "prefill_seconds": None,
                   "draft_seconds": None, "target_seconds": None, "host_seconds": None, **total.to_dict()}
        return {"summary": summary, "tokens": tokens, "per_prompt": per_prompt}

    def generate(self, ids: list[int], max_new_tokens: int) -> tuple[list[int], str, float, RowStats]:
        """One prompt: new token ids up to (not including) the first EOS, the finish reason as specc
        names it ("stop": EOS, "length"), wall seconds, round stats."""
        x = torch.tensor([ids], dtype=torch.long, device=self.model.device)
        stats = RowStats()
        with _assistant_config(self.assistant, self.assistant_config), _record_rounds(self.model, stats), \
                torch.inference_mode():
            start = time.perf_counter()
            out = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                      do_sample=False, assistant_model=self.assistant, **self.kwargs)
            took = time.perf_counter() - start
        new = out[0, len(ids):].tolist()
        stop = next((j for j, t in enumerate(new) if t in self.eos_ids), None)
        return (new, "length", took, stats) if stop is None else (new[:stop], "stop", took, stats)


def neutral_generation_config(model: torch.nn.Module, eos_ids: list[int], pad_id: int):
    """A generation_config with only EOS / pad / BOS ids: greedy `generate` then applies no logits processor."""
    from transformers import GenerationConfig

    bos = getattr(model.generation_config, "bos_token_id", None)
    return GenerationConfig(eos_token_id=list(eos_ids), pad_token_id=pad_id, bos_token_id=bos)


def hf_systems(models: list, k_values: list[int], tokenizer) -> tuple[list[HFSystem], list[dict]]:
    """The Hugging Face systems that apply to these bundles (all of one target), and notes on those skipped.

    k_values: the constant draft lengths to measure (assisted and prompt lookup).
    """
    from ..models.load import load_model

    manifest = models[0].bundle.manifest
    recipe = manifest.recipe
    dtype, device = recipe.target.dtype, recipe.device
    eos_ids = sorted(manifest.tokenizer.eos_token_ids)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]

    target = load_model(manifest.models["target"], dtype, device).model
    target.generation_config = neutral_generation_config(target, eos_ids, pad_id)
    systems = [HFSystem(HF_TARGET_ONLY, target, eos_ids, settings={"api": "generate"})]
    skipped: list[dict] = []
    drafts: dict[str, list] = {}
    for m in models:
        method = get_method(m.draft_method)
        if method.graph == "model":
            drafts.setdefault(m.bundle.manifest.models["draft"], []).append(m)
        elif method.drafter is not None:
            skipped.append({"system": "hf assisted", "bundle": m.bundle.path.name,
                            "reason": f"draft.method {method.name}: {_not_assisted(method)}"})

    for source, users in drafts.items():
        draft = load_model(source, dtype, device).model
        draft.generation_config = _with_assisted_defaults(neutral_generation_config(draft, eos_ids, pad_id),
                                                          draft.generation_config)
        label = Path(source).name
        quantized = sorted({u.bundle.path.name for u in users if u.bundle.graph("draft").quantize})
        note = {"note": f"unquantised draft weights (specc's {', '.join(quantized)} quantise them)"} if quantized else {}
        default = draft.generation_config
        systems.append(HFSystem(f"hf assisted [{label}] default", target, eos_ids, assistant=draft,
                                assistant_config=default, settings={
                                    "api": "generate(assistant_model=...)", "draft": source,
                                    "num_assistant_tokens": default.num_assistant_tokens,
                                    "num_assistant_tokens_schedule": default.num_assistant_tokens_schedule,
                                    "assistant_confidence_threshold": default.assistant_confidence_threshold, **note}))
        for k in k_values:
            constant = copy.deepcopy(default)
            constant.num_assistant_tokens = k
            constant.num_assistant_tokens_schedule = "constant"
            constant.assistant_confidence_threshold = 0.0
            systems.append(HFSystem(f"hf assisted [{label}] k={k}", target, eos_ids, assistant=draft,
                                    assistant_config=constant, settings={
                                        "api": "generate(assistant_model=...)", "draft": source, "num_assistant_tokens": k,
                                        "num_assistant_tokens_schedule": "constant",
                                        "assistant_confidence_threshold": 0.0, **note}))

    lookup = next((m for m in models if get_method(m.draft_method).ngram_lookup), None)
    ngram = lookup.bundle.recipe.draft.max_ngram if lookup else 2
    for k in k_values:
        systems.append(HFSystem(f"hf prompt lookup k={k}", target, eos_ids,
                                kwargs={"prompt_lookup_num_tokens": k, "max_matching_ngram_size": ngram},
                                settings={"api": "generate(prompt_lookup_num_tokens=...)", "prompt_lookup_num_tokens": k,
                                          "max_matching_ngram_size": ngram}))
    return systems, skipped


def _not_assisted(method: DraftMethod) -> str:
    """Why `hf assisted` has no system for a bundle of this method, and what compares with it instead."""
    reason = NOT_ASSISTED[method.graph]
    return f"{reason}; the comparable Hugging Face system is hf prompt lookup" if method.ngram_lookup else reason


def _with_assisted_defaults(config, loaded):
    """The neutral config, keeping the loaded draft's assisted-generation settings if it has any."""
    from transformers import GenerationConfig

    if hasattr(GenerationConfig, "_get_default_generation_params"):  # transformers 5
        defaults = GenerationConfig._get_default_generation_params()
    else:  # transformers 4: the defaults are the attributes of a fresh config
        defaults = GenerationConfig().to_dict()
    for name in ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold"):
        value = getattr(loaded, name, None)
        setattr(config, name, defaults[name] if value is None else value)
    return config


@contextmanager
def _assistant_config(assistant, config) -> Iterator[None]:
    """Give the assistant this system's generation_config (a fresh copy: "heuristic" schedules edit it)."""
    if assistant is None:
        yield
        return
    saved = assistant.generation_config
    assistant.generation_config = copy.deepcopy(config)
    try:
        yield
    finally:
        assistant.generation_config = saved


@contextmanager
def _record_rounds(model, stats: RowStats) -> Iterator[None]:
    """Record (drafted, accepted) of every assisted round into stats (see the module docstring)."""
    original = getattr(model, "_get_candidate_generator", None)
    if original is None:
        yield
        return

    def wrapped(*args, **kwargs):
        generator = original(*args, **kwargs)
        update = generator.update_candidate_strategy

        def record(input_ids, scores, num_matches):
            stats.record(int(scores.shape[1]) - 1, int(num_matches))
            return update(input_ids, scores, num_matches)

        generator.update_candidate_strategy = record
        return generator

    model._get_candidate_generator = wrapped
    try:
        yield
    finally:
        del model._get_candidate_generator

