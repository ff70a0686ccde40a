"""Shapes of step graphs: model dimensions, dynamic ranges and example inputs for tracing."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from .step_decoder import StepDecoder


@dataclass
class ModelDims:
    """What the runtime needs to size a step graph's cache and read its logits."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    dtype: str = "float32"

    @classmethod
    def of(cls, decoder: StepDecoder, dtype: torch.dtype) -> "ModelDims":
        return cls(decoder.n_layers, decoder.n_kv_heads, decoder.head_dim, decoder.vocab_size, str(dtype).removeprefix("torch."))

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class DimRanges:
    """Inclusive [min, max] of every dynamic dimension a graph is compiled for."""

    batch: tuple[int, int]
    tokens: tuple[int, int]
    rows: tuple[int, int]
    cache: tuple[int, int]
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        out = {"batch": list(self.batch), "tokens": list(self.tokens), "rows": list(self.rows), "cache": list(self.cache)}
        out.update({k: list(v) for k, v in self.extra.items()})
        return out


def dim_ranges(max_batch: int, max_context: int) -> DimRanges:
    return DimRanges(batch=(1, max_batch), tokens=(1, max_context), rows=(1, max_context), cache=(1, max_context))


def example_inputs(dims: ModelDims, dtype: torch.dtype, batch: int = 2, tokens: int = 3, cache: int = 5,
                   device: torch.device | str = "cpu") -> dict:
    """Distinct, non-view example inputs (torch.export specialises on 0/1 and on aliasing)."""
    kv_shape = (dims.n_layers, batch, dims.n_kv_heads, cache, dims.head_dim)
    out = {
        "input_ids": torch.randint(0, dims.vocab_size, (batch, tokens)),
        "position_ids": (torch.arange(tokens) + 2).repeat(batch, 1),
        "cache_len": torch.full((batch,), 2, dtype=torch.long),
        "logit_index": torch.arange(tokens).repeat(batch, 1),
        "k_cache": torch.randn(kv_shape).to(dtype),
        "v_cache": torch.randn(kv_shape).to(dtype),
    }
    return {name: t.to(device) for name, t in out.items()}


AXES: dict[str, dict[int, str]] = {
    "input_ids": {0: "batch", 1: "tokens"},
    "position_ids": {0: "batch", 1: "tokens"},
    "cache_len": {0: "batch"},
    "logit_index": {0: "batch", 1: "rows"},
    "k_cache": {1: "batch", 3: "cache"},
    "v_cache": {1: "batch", 3: "cache"},
}

