"""What a model family is: the traits in which it differs from a Llama-style decoder.

A family file builds one `Family`; `step_decoder.StepDecoder` assembles the step graph from
it over the Hugging Face model's own modules. Defaults describe Llama.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from torch import nn


@dataclass(frozen=True)
class Family:
    name: str  # registry key, e.g. "gemma2"
    title: str  # e.g. "Gemma 2"
    model_types: tuple[str, ...]  # config.json model_type values this family compiles
    notes: str = ""
    # the four norm slots of a layer: HF attribute names, None where the family has none
    pre_attn_norm: str | None = "input_layernorm"
    post_attn_norm: str | None = None
    pre_mlp_norm: str | None = "post_attention_layernorm"
    post_mlp_norm: str | None = None
    norm_offset: float = 0.0  # Gemma norms scale by (1 + w)
    qk_norm: str | None = None  # "head" (after the head split) | "projection" (before it)
    fused_qkv: bool = False  # one qkv_proj (Phi-3)
    interleaved_rope: bool = False  # rotate pairs (0,1),(2,3)... (GLM) instead of halves
    window: str = "none"  # sliding window on "none" | "all" layers (when config.sliding_window) | "layer_types"
    rope_per_layer_type: bool = False  # one rotary table per layer type (Gemma 3 local/global bases)
    rope_layers: Callable[[object], list[bool]] | None = None  # which layers use rope (SmolLM3); None: all
    sinks: bool = False  # per-head attention sink logits (GPT-OSS)
    # config attributes holding scaling constants (None: the family has none)
    embedding_multiplier: str | None = None
    residual_multiplier: str | None = None
    logits_divisor: str | None = None
    attn_softcap: str | None = None
    final_softcap: str | None = None
    # the MLP of layer i as a step-graph module (None: the HF module as it is)
    mlp: Callable[[nn.Module, object, int], nn.Module] | None = None
    # config problems this family cannot compile (each an "unsupported ...: ..." sentence)
    problems: Callable[[object], list[str]] | None = None
    # extra config for a tiny random test model (specc.testing)
    tiny: dict = field(default_factory=dict)
    # HF attention implementation the tiny model is compared against (None: HF's default)
    hf_attention: str | None = None
    # verified on real weights: catalog name(s) checked against HF in a real_model test
    real_checkpoints: tuple[str, ...] = ()

    def config_value(self, config, attr: str | None, default=None):
        return default if attr is None else getattr(config, attr, default)

    def sliding_windows(self, config) -> list[int | None]:
        """The sliding window of each layer (None: global attention), as HF masks it."""
        n, window = config.num_hidden_layers, getattr(config, "sliding_window", None)
        if self.window == "none" or window is None:
            return [None] * n
        if self.window == "all":
            return [window] * n
        return [window if t == "sliding_attention" else None for t in config.layer_types]

    def rope_keys(self, config) -> list[str]:
        if self.rope_per_layer_type:
            return list(config.layer_types)
        return ["default"] * config.num_hidden_layers
