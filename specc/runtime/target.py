"""The target step: one pass of the target graph that decides each row's next tokens.

Prefill, plain decoding, chain verification and `specc tune` all call `Target.decide`. A graph
compiled with the verification head (passes/insert_verify_head.py) accepts inside the engine;
otherwise the same rules run here on the logits (speculation/sampling.py). Either way only
the accepted length and the next token per row come back, with the new tokens' KV.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..speculation.sampling import RowParams, accept, choose
from .drafters.base import Proposal
from .kv_cache import KVCache
from .step import StepRunner


@dataclass
class Verdict:
    """The target's decision for a batch: accepted drafts and the next token per row, the new
    tokens' KV (committed by the caller) and any further graph outputs by name (for drafters)."""

    n_accepted: torch.Tensor  # [B]
    next_token: torch.Tensor  # [B]
    new_k: torch.Tensor
    new_v: torch.Tensor
    extra: dict[str, torch.Tensor] = field(default_factory=dict)


class Target:
    """The compiled target graph behind `decide` (chain rounds) and `logits` (tree rounds)."""

    def __init__(self, step: StepRunner, output_names: list[str]):
        self.step, self.output_names = step, list(output_names)
        self.verify_head = "n_accepted" in self.output_names

    @property
    def dims(self):
        return self.step.dims

    def decide(self, cache: KVCache, ids: torch.Tensor, rows: torch.Tensor, params: RowParams, u_next: torch.Tensor,
               proposal: Proposal | None = None, u_accept: torch.Tensor | None = None) -> Verdict:
        """Run ids [B, T] against cache; read logits at rows [B, R]; accept the proposal's drafts
        (ids[:, 1:] are its tokens) or, without one, choose the next token from the first row."""
        if self.verify_head:
            outputs = self._head_call(cache, ids, rows, params, u_next, proposal, u_accept)
            n_acc, nxt = outputs["n_accepted"], outputs["next_token"]
        else:
            outputs = dict(zip(self.output_names, self.step(ids, cache, logit_index=rows)))
            logits = outputs["logits"]
            if proposal is None:
                nxt, _ = choose(logits[:, 0], params, u_next)
                n_acc = torch.zeros_like(nxt)
            else:
                n_acc, nxt = accept(logits, proposal.q, proposal.tokens, proposal.lengths, params, u_accept, u_next)
        extra = {n: v for n, v in outputs.items() if n not in ("logits", "n_accepted", "next_token", "new_k", "new_v")}
        return Verdict(n_acc, nxt, outputs["new_k"], outputs["new_v"], extra)

    def logits(self, ids: torch.Tensor, cache: KVCache, rows: torch.Tensor, positions: torch.Tensor | None = None,
               tree_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits [B, R, V], new_k, new_v) of one pass: tree rounds accept on the host."""
        return self.step(ids, cache, logit_index=rows, positions=positions, tree_mask=tree_mask)[:3]

    def _head_call(self, cache, ids, rows, params, u_next, proposal, u_accept) -> dict[str, torch.Tensor]:
        """The verification head's inputs. Without drafts (prefill, plain decode, an empty lookup)
        it gets one dummy draft and n_draft 0, so it samples the next token from the first row."""
        b, device, vocab = ids.shape[0], ids.device, self.dims.vocab_size
        if proposal is None or proposal.tokens.shape[1] == 0:
            draft = torch.zeros(b, 1, dtype=torch.long, device=device)
            n_draft = torch.zeros(b, dtype=torch.long, device=device)
            u_accept = torch.zeros(b, 1, device=device)
            rows = torch.cat([rows, rows[:, -1:]], dim=1)
            q = None
        else:
            draft, n_draft, q = proposal.tokens, proposal.lengths, proposal.q
        if q is None:
            q = torch.zeros(b, draft.shape[1], vocab, device=device)
        outs = self.step(ids, cache, logit_index=rows, draft_tokens=draft, draft_probs=q, n_draft=n_draft,
                         temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                         u_accept=u_accept, u_next=u_next)
        return dict(zip(self.output_names, outs))
