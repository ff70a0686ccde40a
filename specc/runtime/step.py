"""Calling a compiled step graph with a KVCache (the ABI in capture/step_decoder.py)."""
from __future__ import annotations

import torch

from ..capture.shapes import ModelDims
from .kv_cache import KVCache


def pad_right(rows: list[list[int]], device, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] right-padded ids and the [B] row lengths."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = torch.tensor(r, dtype=torch.long)
    return ids.to(device), torch.tensor([len(r) for r in rows], dtype=torch.long, device=device)


class StepRunner:
    """A loaded graph plus the bookkeeping of where its new tokens sit.

    Positions default to cache_len + offset (a chain); trees pass positions from depth and
    a tree_mask. Graphs compiled with the tree pass get a causal tree_mask when none is given.
    """

    def __init__(self, runner, dims: ModelDims, device: torch.device, input_names: list[str]):
        self.runner, self.dims, self.device, self.input_names = runner, dims, device, input_names
        self.has_tree_mask = "tree_mask" in input_names

    def __call__(self, ids: torch.Tensor, cache: KVCache, logit_index: torch.Tensor,
                 positions: torch.Tensor | None = None, tree_mask: torch.Tensor | None = None,
                 **extra: torch.Tensor) -> list[torch.Tensor]:
        b, t = ids.shape
        if positions is None:
            positions = cache.lengths[:, None] + torch.arange(t, device=ids.device)[None, :]
        values = {"input_ids": ids, "position_ids": positions, "cache_len": cache.lengths,
                  "logit_index": logit_index, "k_cache": cache.k, "v_cache": cache.v, **extra}
        if self.has_tree_mask:
            if tree_mask is None:
                tree_mask = torch.tril(torch.ones(t, t, dtype=torch.bool, device=ids.device)).expand(b, t, t)
            values["tree_mask"] = tree_mask.contiguous()
        elif tree_mask is not None:
            raise ValueError("this graph was compiled without the tree pass; it takes no tree_mask")
        return self.runner(*(values[name] for name in self.input_names))
