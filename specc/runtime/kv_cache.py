"""The runtime-owned KV cache: commit on accept, roll back by not advancing."""
from __future__ import annotations

import torch

from ..capture.export import ModelDims

BLOCK = 64  # capacity grows in blocks so the graphs see few distinct cache sizes


class KVCache:
    """Keys and values `[L, B, H, S, D]` with a valid length per row.

    Slots past a row's length may hold stale data from rejected drafts; the graphs mask
    them by `cache_len`, so rolling back is only lowering the length.
    """

    def __init__(self, dims: ModelDims, batch: int, max_context: int, device: torch.device | str = "cpu"):
        self.dims, self.max_context = dims, max_context
        dtype = getattr(torch, dims.dtype)
        shape = (dims.n_layers, batch, dims.n_kv_heads, 0, dims.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    def ensure(self, needed: int) -> None:
        """Grow capacity (by whole blocks, at most max_context) to hold `needed` slots per row."""
        if needed <= self.capacity:
            return
        if needed > self.max_context:
            raise ValueError(f"cache needs {needed} slots, above max_context {self.max_context}")
        new_cap = min(self.max_context, -(-needed // BLOCK) * BLOCK)
        pad = list(self.k.shape)
        pad[3] = new_cap - self.capacity
        self.k = torch.cat([self.k, self.k.new_zeros(pad)], dim=3)
        self.v = torch.cat([self.v, self.v.new_zeros(pad)], dim=3)

    def commit(self, new_k: torch.Tensor, new_v: torch.Tensor, counts: torch.Tensor,
               index: torch.Tensor | None = None) -> None:
        """Append the first counts[b] new tokens of each row (or the tokens at index[b, :counts[b]])."""
        starts = self.lengths.tolist()
        for b, n in enumerate(counts.tolist()):
            if n == 0:
                continue
            s = starts[b]
            if index is None:
                self.k[:, b, :, s:s + n] = new_k[:, b, :, :n]
                self.v[:, b, :, s:s + n] = new_v[:, b, :, :n]
            else:
                idx = index[b, :n]
                self.k[:, b, :, s:s + n] = new_k[:, b, :, idx]
                self.v[:, b, :, s:s + n] = new_v[:, b, :, idx]
        self.lengths += counts.to(self.lengths.device)

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Drop finished rows; `rows` lists the batch indices that stay, in order."""
        self.k = self.k.index_select(1, rows).contiguous()
        self.v = self.v.index_select(1, rows).contiguous()
        self.lengths = self.lengths.index_select(0, rows)

    def extend(self, other: "KVCache") -> None:
        """Append other's rows along the batch axis, padding the smaller capacity."""
        self.ensure(other.capacity)
        other.ensure(self.capacity)
        self.k = torch.cat([self.k, other.k], dim=1)
        self.v = torch.cat([self.v, other.v], dim=1)
        self.lengths = torch.cat([self.lengths, other.lengths])
