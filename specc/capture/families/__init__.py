"""The model-family registry: which `Family` compiles a Hugging Face config, or exactly why none does.

Adding a family: one file here defining `FAMILY = Family(...)` with what differs from Llama,
listed in `_MODULES`; the parametrised registry test picks it up through `Family.tiny`.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

from ...errors import ModelError
from ..blocks.rope import STATIC_ROPE_TYPES
from .base import Family

_MODULES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3", "granite", "olmo2",
            "smollm3", "starcoder2", "glm4", "mixtral", "qwen3_moe", "gpt_oss")

FAMILIES: dict[str, Family] = {
    f.name: f for f in (importlib.import_module(f"{__name__}.{m}").FAMILY for m in _MODULES)
}
BY_MODEL_TYPE: dict[str, Family] = {t: f for f in FAMILIES.values() for t in f.model_types}

# model types that are known and refused, with the reason
KNOWN_UNSUPPORTED = {
    "deepseek_v2": "unsupported attention variant: multi-head latent attention (MLA; keys and values of "
                   "different head sizes, the KV cache holds one head_dim)",
    "deepseek_v3": "unsupported attention variant: multi-head latent attention (MLA; keys and values of "
                   "different head sizes, the KV cache holds one head_dim)",
    "gemma3": "multimodal Gemma 3 (vision tower + text); compile a text-only checkpoint (model_type gemma3_text)",
    "phi": "unsupported layer layout: Phi-1/Phi-2 parallel attention+MLP with a dense partial-rotary head",
    "gpt2": "unsupported position encoding: learned absolute positions (GPT-2)",
    "falcon": "unsupported layer layout: Falcon parallel attention/MLP with multi-query fused projections",
}


def supported_model_types() -> tuple[str, ...]:
    return tuple(BY_MODEL_TYPE)


def problems(config) -> list[str]:
    """Everything in `config` the registry cannot compile (empty: it compiles)."""
    model_type = getattr(config, "model_type", None)
    if model_type in KNOWN_UNSUPPORTED:
        return [KNOWN_UNSUPPORTED[model_type]]
    family = BY_MODEL_TYPE.get(model_type)
    if family is None:
        return [f"unknown model_type {model_type!r}; supported: {', '.join(supported_model_types())}"]
    out = []
    if getattr(config, "kv_lora_rank", None) or getattr(config, "q_lora_rank", None):
        out.append("unsupported attention variant: multi-head latent attention (kv_lora_rank/q_lora_rank)")
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if isinstance(kv, (list, tuple)) or isinstance(heads, (list, tuple)):
        out.append("unsupported layer shapes: per-layer head counts (the KV cache [L,B,H,S,D] holds one H and D)")
    elif heads % kv:
        out.append(f"unsupported attention shape: {heads} query heads not a multiple of {kv} key/value heads")
    rope = getattr(config, "rope_parameters", None) or {}
    tables = rope.values() if family.rope_per_layer_type else [rope]
    for params in tables:
        rope_type = (params or {}).get("rope_type", "default")
        if rope_type not in STATIC_ROPE_TYPES:
            out.append(f"unsupported rope variant: {rope_type!r} (frequencies recomputed from the sequence length "
                       f"inside the forward); supported: {', '.join(STATIC_ROPE_TYPES)}")
    if family.window == "layer_types" and getattr(config, "layer_types", None) is not None:
        unknown = sorted(set(config.layer_types) - {"full_attention", "sliding_attention"})
        if unknown:
            out.append(f"unsupported attention variant: layer types {unknown} (known: full_attention, sliding_attention)")
    if family.problems:
        out += family.problems(config)
    return out


def family_for(config) -> Family:
    """The family that compiles `config`; ModelError naming every problem otherwise."""
    found = problems(config)
    if found:
        raise ModelError(f"model_type {getattr(config, 'model_type', None)!r} cannot be compiled: " + "; ".join(found))
    return BY_MODEL_TYPE[config.model_type]


@dataclass
class CheckReport:
    """`specc models check`: the family (or None) and the facts or problems behind the verdict."""

    model_type: str | None
    family: Family | None
    problems: list[str]
    facts: list[str]


def check_config(config) -> CheckReport:
    found = problems(config)
    family = None if found else BY_MODEL_TYPE[config.model_type]
    facts = []
    if family is not None:
        n = config.num_hidden_layers
        windows = family.sliding_windows(config)
        kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        facts.append(f"{n} layers, hidden {config.hidden_size}, {config.num_attention_heads} query / {kv} key-value "
                     f"heads of {head_dim}, vocab {config.vocab_size}")
        sliding = [w for w in windows if w]
        if sliding:
            facts.append(f"sliding window {sliding[0]} on {len(sliding)} of {n} layers (masked; the cache keeps every slot)")
        if family.rope_layers:
            facts.append(f"rope on {sum(family.rope_layers(config))} of {n} layers")
        if family.mlp is not None and (getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)):
            e = getattr(config, "num_local_experts", None) or config.num_experts
            facts.append(f"mixture of experts: top-{config.num_experts_per_tok} of {e}, computed densely "
                         f"({e / config.num_experts_per_tok:.0f}x the expert FLOPs of a sparse kernel)")
        if family.notes:
            facts.append(family.notes)
    return CheckReport(getattr(config, "model_type", None), family, found, facts)
