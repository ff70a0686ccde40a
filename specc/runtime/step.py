"""Calling a compiled step graph with a KVCache (the ABI in capture/step_decoder.py)."""
from __future__ import annotations

import torch

from ..capture.export import ModelDims
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

    Positions default to cache_len + offset (chain); tree graphs pass positions from depth.
    """

    def __init__(self, runner, dims: ModelDims, device: torch.device):
        self.runner, self.dims, self.device = runner, dims, device

    def __call__(self, ids: torch.Tensor, cache: KVCache, logit_index: torch.Tensor,
                 positions: torch.Tensor | None = None, extra: tuple = ()) -> list[torch.Tensor]:
        if positions is None:
            positions = cache.lengths[:, None] + torch.arange(ids.shape[1], device=ids.device)[None, :]
        return self.runner(ids, positions, cache.lengths, logit_index, cache.k, cache.v, *extra)
