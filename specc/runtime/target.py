"""The compiled target graph: one pass over a batch's new tokens against its KV cache.

A graph compiled with the verification head (passes/insert_verify_head.py) also takes the drafts
and the sampling noise and returns the accepted length and next token per row itself; the
verifier (runtime/verifier.py) decides which rule runs.
"""
from __future__ import annotations

import torch

from ..speculation.sampling import RowParams
from .kv_cache import KVCache
from .step import StepRunner

OWN_OUTPUTS = ("logits", "n_accepted", "next_token", "new_k", "new_v")  # the rest are for drafters (`Verdict.extra`)


class Target:
    """The target step graph and its output names."""

    def __init__(self, step: StepRunner, output_names: list[str]):
        self.step, self.output_names = step, list(output_names)
        self.verify_head = "n_accepted" in self.output_names

    @property
    def dims(self):
        return self.step.dims

    def outputs(self, ids: torch.Tensor, cache: KVCache, rows: torch.Tensor, positions: torch.Tensor | None = None,
                tree_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Every output of one pass over ids [B, T], logits read at rows [B, R], by name."""
        return dict(zip(self.output_names, self.step(ids, cache, logit_index=rows, positions=positions, tree_mask=tree_mask)))

    def head_outputs(self, cache: KVCache, ids: torch.Tensor, rows: torch.Tensor, params: RowParams,
                     u_next: torch.Tensor, draft: torch.Tensor | None = None, n_draft: torch.Tensor | None = None,
                     q: torch.Tensor | None = None, u_accept: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """One pass of a graph with the verification head. Without drafts (prefill, plain decode, an empty
        proposal) it gets one dummy draft and n_draft 0, so it samples the next token from the first row."""
        b, device, vocab = ids.shape[0], ids.device, self.dims.vocab_size
        if draft is None or draft.shape[1] == 0:
            draft = torch.zeros(b, 1, dtype=torch.long, device=device)
            n_draft = torch.zeros(b, dtype=torch.long, device=device)
            u_accept = torch.zeros(b, 1, device=device)
            rows = torch.cat([rows, rows[:, -1:]], dim=1)
            q = None
        if q is None:
            q = torch.zeros(b, draft.shape[1], vocab, device=device)
        outs = self.step(ids, cache, logit_index=rows, draft_tokens=draft, draft_probs=q, n_draft=n_draft,
                         temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                         u_accept=u_accept, u_next=u_next)
        return dict(zip(self.output_names, outs))
