"""The runtime-owned KV cache: commit on accept, roll back by not advancing."""
from __future__ import annotations

import torch

from ..capture.shapes import ModelDims

BLOCK = 64  # capacity grows in blocks so the graphs see few distinct cache sizes


def _write(k, v, lengths, new_k, new_v, counts, index) -> None:
    """Copy each row's new tokens into k/v at that row's length."""
    for b, (s, n) in enumerate(zip(lengths.tolist(), counts.tolist())):
        if n == 0:
            continue
        if index is None:
            k[:, b, :, s:s + n] = new_k[:, b, :, :n]
            v[:, b, :, s:s + n] = new_v[:, b, :, :n]
        else:
            idx = index[b, :n]
            k[:, b, :, s:s + n] = new_k[:, b, :, idx]
            v[:, b, :, s:s + n] = new_v[:, b, :, idx]


def _blocks(slots: int) -> int:
    """Slots rounded up to whole blocks."""
    return -(-slots // BLOCK) * BLOCK


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
        new_cap = min(self.max_context, _blocks(needed))
        pad = list(self.k.shape)
        pad[3] = new_cap - self.capacity
        self.k = torch.cat([self.k, self.k.new_zeros(pad)], dim=3)
        self.v = torch.cat([self.v, self.v.new_zeros(pad)], dim=3)

    def commit(self, new_k: torch.Tensor, new_v: torch.Tensor, counts: torch.Tensor,
               index: torch.Tensor | None = None) -> None:
        """Append the first counts[b] new tokens of each row (or the tokens at index[b, :counts[b]])."""
        _write(self.k, self.v, self.lengths, new_k, new_v, counts, index)
        self.lengths += counts.to(self.lengths.device)

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Drop finished rows; `rows` lists the batch indices that stay, in order.

        Capacity shrinks to what the longest remaining row needs: the graphs attend over the
        whole capacity, so a long row that left would otherwise tax every later round."""
        self.lengths = self.lengths.index_select(0, rows)
        cap = min(self.capacity, _blocks(int(self.lengths.max()) + 1)) if len(rows) else 0
        self.k = self.k[:, :, :, :cap].index_select(1, rows).contiguous()
        self.v = self.v[:, :, :, :cap].index_select(1, rows).contiguous()

    def take(self, rows: list[int]) -> "KVCache":
        """A copy of these rows (e.g. to run a few rows through a graph without the others)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.lengths.device)
        sub = KVCache(self.dims, 0, self.max_context, self.lengths.device)
        sub.k, sub.v = self.k.index_select(1, index), self.v.index_select(1, index)
        sub.lengths = self.lengths.index_select(0, index)
        return sub

    def put(self, rows: list[int], sub: "KVCache") -> None:
        """Write back rows taken with `take` (and extended since)."""
        self.ensure(sub.capacity)
        index = torch.tensor(rows, dtype=torch.long, device=self.lengths.device)
        self.k[:, index, :, :sub.capacity] = sub.k
        self.v[:, index, :, :sub.capacity] = sub.v
        self.lengths[index] = sub.lengths

    def extend(self, other: "KVCache") -> None:
        """Append other's rows along the batch axis, padding the smaller capacity."""
        self.ensure(other.capacity)
        other.ensure(self.capacity)
        self.k = torch.cat([self.k, other.k], dim=1)
        self.v = torch.cat([self.v, other.v], dim=1)
        self.lengths = torch.cat([self.lengths, other.lengths])


class LayerView:
    """The first n layers of another cache, with lengths of its own.

    An early-exit draft is the target's first layers, so the target's committed KV is
    exactly the draft's: the draft reads it in place and writes its speculative tokens past
    the target's length, where the target's next commit overwrites them.
    """

    def __init__(self, base: KVCache, n_layers: int):
        self.base, self.n_layers = base, n_layers
        self.lengths = base.lengths.clone()

    @property
    def k(self) -> torch.Tensor:
        return self.base.k[: self.n_layers]

    @property
    def v(self) -> torch.Tensor:
        return self.base.v[: self.n_layers]

    def ensure(self, needed: int) -> None:
        self.base.ensure(needed)

    def commit(self, new_k: torch.Tensor, new_v: torch.Tensor, counts: torch.Tensor,
               index: torch.Tensor | None = None) -> None:
        _write(self.k, self.v, self.lengths, new_k, new_v, counts, index)
        self.lengths += counts.to(self.lengths.device)
