"""Medusa and EAGLE heads as step graphs (StepGraph), so passes and backends treat them like any draft graph."""
from __future__ import annotations

import torch

from ..capture.graph import InputSpec, StepGraph, export_module
from ..capture.shapes import DimRanges, ModelDims
from .eagle import EagleBase
from .medusa import MedusaHeads


def capture_head(role: str, head: torch.nn.Module, ranges: DimRanges, batch: int = 2, tokens: int = 3,
                 cache: int = 5) -> StepGraph:
    """Trace a head with dynamic batch/tokens/rows/cache axes (module docstrings of medusa.py and eagle.py)."""
    head = head.eval()
    vocab = head.vocab.vocab_size
    if isinstance(head, MedusaHeads):
        hidden = head.heads[0][0].linear.in_features if len(head.heads[0]) else head.shared.shape[1]
        inputs = [InputSpec("features", torch.randn(batch, tokens, hidden), {0: "batch", 1: "rows"})]
        outputs = ["logits"]
        dims = ModelDims(0, 0, 0, vocab)
    elif isinstance(head, EagleBase):
        kv = (1, batch, head.n_kv_heads, cache, head.head_dim)
        inputs = [
            InputSpec("input_ids", torch.randint(0, vocab, (batch, tokens)), {0: "batch", 1: "tokens"}),
            InputSpec("features", torch.randn(batch, tokens, head.hidden), {0: "batch", 1: "tokens"}),
            InputSpec("position_ids", (torch.arange(tokens) + 2).repeat(batch, 1), {0: "batch", 1: "tokens"}),
            InputSpec("cache_len", torch.full((batch,), 2, dtype=torch.long), {0: "batch"}),
            InputSpec("logit_index", torch.arange(tokens).repeat(batch, 1), {0: "batch", 1: "rows"}),
            InputSpec("k_cache", torch.randn(kv), {1: "batch", 3: "cache"}),
            InputSpec("v_cache", torch.randn(kv), {1: "batch", 3: "cache"}),
        ]
        outputs = ["logits", "hidden", "new_k", "new_v"]
        dims = ModelDims(1, head.n_kv_heads, head.head_dim, vocab)
    else:
        raise TypeError(f"not a draft head: {type(head).__name__}")
    ep = export_module(head, inputs, ranges)
    return StepGraph.from_exported(role, ep, inputs, outputs, ranges, dims)
