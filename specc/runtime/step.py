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


DEFAULT_CHUNK = 256  # prompt tokens per prefill pass (Engine.prefill_chunk): linear prefill, bounded masks

TOKEN_AXIS = {"new_k": 3, "new_v": 3, "features": 1}  # outputs with one entry per new token
LOGIT_AXIS = {"logits": 1, "exit_logits": 1}  # outputs with one entry per logit_index row (the LM head's pass)


class StepRunner:
    """A loaded graph plus the bookkeeping of where its new tokens sit.

    Positions default to cache_len + offset (a chain); trees pass positions from depth and
    a tree_mask. Graphs compiled with the tree pass get a causal tree_mask when none is given.

    `min_rows`: a pass of fewer rows (batch x tokens) runs with copies of each row's last token
    beside it, which nothing attends to and whose outputs are dropped, where the kernels give a
    row other bits in smaller passes than in larger ones (hardware.py `min_pass_rows_here`). The LM head
    runs on the logit_index rows only, so those are padded the same way (a verification head's
    graph reads at least 2: the next token's row and a draft's).

    `vocab_ids`: the token ids of the graph's logits columns, where its LM head keeps only some (draft.vocab);
    the logits it returns are then widened to the whole vocabulary.
    """

    def __init__(self, runner, dims: ModelDims, device: torch.device, input_names: list[str],
                 output_names: list[str] | None = None, min_rows: int = 1, vocab_ids: torch.Tensor | None = None):
        self.runner, self.dims, self.device, self.input_names = runner, dims, device, input_names
        self.output_names, self.min_rows = output_names or [], min_rows
        self.vocab_ids = None if vocab_ids is None else vocab_ids.to(device)
        self.has_tree_mask = "tree_mask" in input_names
        self.reads_logits = "logits" in self.output_names  # a verification head's graph reads its own

    def __call__(self, ids: torch.Tensor, cache: KVCache, logit_index: torch.Tensor,
                 positions: torch.Tensor | None = None, tree_mask: torch.Tensor | None = None,
                 **extra: torch.Tensor) -> list[torch.Tensor]:
        b, t = ids.shape
        if tree_mask is not None and not self.has_tree_mask:
            raise ValueError("this graph was compiled without the tree pass; it takes no tree_mask")
        # room for every new token at its slot: ONNX Runtime target graphs write each new key into the cache's
        # copy at its position (onnx_passes/attend_at_cache_positions.py)
        cache.ensure(int(cache.lengths.max()) + t if b else 0)
        if positions is None:
            positions = cache.lengths[:, None] + torch.arange(t, device=ids.device)[None, :]
        pad = self._columns_short(b, t)
        if pad:
            ids, positions = _repeat_last(ids, pad), _repeat_last(positions, pad)
            tree_mask = _pad_mask(tree_mask, pad) if tree_mask is not None else None
        r = logit_index.shape[1]
        pad_r = self._columns_short(b, r) if self.reads_logits else 0
        if pad_r:
            logit_index = _repeat_last(logit_index, pad_r)
        values = {"input_ids": ids, "position_ids": positions, "cache_len": cache.lengths,
                  "logit_index": logit_index, "k_cache": cache.k, "v_cache": cache.v, **extra}
        if self.has_tree_mask:
            if tree_mask is None:
                n = ids.shape[1]
                tree_mask = torch.tril(torch.ones(n, n, dtype=torch.bool, device=ids.device)).expand(b, n, n)
            values["tree_mask"] = tree_mask.contiguous()
        outputs = self.runner(*(values[name] for name in self.input_names))
        if pad or pad_r:
            keep = {**{n: (a, t) for n, a in TOKEN_AXIS.items()}, **{n: (a, r) for n, a in LOGIT_AXIS.items()}}
            outputs = [o.narrow(keep[name][0], 0, keep[name][1]) if name in keep else o
                       for name, o in zip(self.output_names, outputs)]
        if self.vocab_ids is not None:
            outputs = [self._widen(o) if name == "logits" else o for name, o in zip(self.output_names, outputs)]
        return outputs

    def _widen(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits over the kept ids (passes/restrict_draft_vocab.py) at their ids, every other token at -inf."""
        full = logits.new_full((*logits.shape[:-1], self.dims.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.vocab_ids, logits)

    def _columns_short(self, b: int, n: int) -> int:
        """Columns to add to a [b, n] pass so that it holds at least min_rows rows."""
        return -(-(self.min_rows - b * n) // b) if 0 < b and b * n < self.min_rows else 0


def _repeat_last(x: torch.Tensor, n: int) -> torch.Tensor:
    """x [B, T] with its last column repeated n more times."""
    return torch.cat([x, x[:, -1:].expand(-1, n)], dim=1)


def _pad_mask(mask: torch.Tensor, n: int) -> torch.Tensor:
    """A [B, T, T] tree mask grown by n rows that see only themselves and that no row sees."""
    b, t, _ = mask.shape
    out = torch.eye(t + n, dtype=torch.bool, device=mask.device).expand(b, t + n, t + n).clone()
    out[:, :t, :t] = mask
    return out
