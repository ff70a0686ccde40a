"""Verification: the target pass of a round and the rule that decides what it accepts.

Chains are accepted inside the target graph when it was compiled with the verification head, else
here by speculation/sampling.py's rules on the pass's logits; trees always here, by
speculation/tree.py's. Either way a round gets a `Verdict`: accepted drafts and the next token per
row, and the KV of the tokens to commit.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..speculation.sampling import RowParams, accept, choose, probs_from_logits
from ..speculation.tree import DraftTree, accept_tree_fixed, accept_tree_greedy, accept_tree_sampled, rerank, tree_tensors
from .drafters.base import Proposal
from .kv_cache import KVCache
from .state import Batch
from .step import pad_right
from .target import OWN_OUTPUTS, Target


@dataclass
class Verdict:
    """The target's decision for a batch: n_accepted [B] drafts, next_token [B], the KV of the pass's
    tokens (new_k, new_v) and, for trees, index [B, n_accepted + 1]: which of them to commit in order
    (None: the first n_accepted + 1). extra: further graph outputs by name (features for drafters), in
    committed order."""

    n_accepted: torch.Tensor
    next_token: torch.Tensor
    new_k: torch.Tensor
    new_v: torch.Tensor
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    index: torch.Tensor | None = None
    logprobs: list | None = None  # per row asking for them: its emitted tokens' logprobs (runtime/rules.py)
    prompt_logprobs: list | None = None  # per row asking for them at prefill: its prompt's
    trees: list[DraftTree] | None = None  # a tree round's trees as verified
    tree_argmax: list[list[int]] | None = None  # ... and the target's argmax after each of their nodes

    def commit(self, cache: KVCache) -> None:
        """Write the accepted tokens' KV (and the pending token's) into the cache."""
        cache.commit(self.new_k, self.new_v, self.n_accepted + 1, index=self.index)


class Verifier:
    """Runs the target over a round's tokens and applies the lossless acceptance rule."""

    def __init__(self, target: Target):
        self.target = target

    def next_token(self, cache: KVCache, ids: torch.Tensor, rows: torch.Tensor, params: RowParams,
                   u: torch.Tensor, prompt_at: list[int] | None = None) -> Verdict:
        """No drafts (prefill, a plain decode step): run ids [B, T] and choose each row's next token at rows
        [B, R], at its last column. prompt_at: a prefill chunk reading prompt logprobs (rows: every fed row),
        the prompt position of each row's ids[b, 0]; the verdict then holds that chunk's prompt logprobs."""
        if self.target.verify_head:
            out = self.target.head_outputs(cache, ids, rows, params, u)
            return _verdict(out, out["n_accepted"], out["next_token"])
        out = self.target.outputs(ids, cache, rows)
        rules, logits = params.rules, out["logits"][:, -1:]
        logits = rules.apply(logits) if rules else logits
        nxt, _ = choose(logits[:, 0], params, u)
        verdict = _verdict(out, torch.zeros_like(nxt), nxt)
        if rules:
            verdict.logprobs = rules.logprobs(logits, [[t] for t in nxt.tolist()])
            if prompt_at is not None:
                verdict.prompt_logprobs = rules.prompt_logprobs(out["logits"], prompt_at, (rows[:, -1] + 1).tolist())
        return verdict

    def chain(self, batch: Batch, proposal: Proposal, params: RowParams, u_accept: torch.Tensor,
              u_next: torch.Tensor) -> Verdict:
        """Run each row's pending token and drafts in one pass; accept a prefix of the drafts."""
        cache, width = batch.cache, proposal.tokens.shape[1]
        cache.ensure(int(cache.lengths.max()) + width + 1)
        ids = torch.cat([batch.pending[:, None], proposal.tokens], dim=1)
        rows = torch.arange(width + 1, device=ids.device).expand(ids.shape[0], -1)
        if self.target.verify_head:
            out = self.target.head_outputs(cache, ids, rows, params, u_next, proposal.tokens, proposal.lengths,
                                           proposal.q, u_accept)
            return _verdict(out, out["n_accepted"], out["next_token"])
        rules, lengths = params.rules, proposal.lengths
        if rules:  # a draft the grammar forbids ends the chain
            lengths = rules.clip(proposal.tokens, lengths)
        out = self.target.outputs(ids, cache, rows)
        logits = rules.apply(out["logits"], proposal.tokens) if rules else out["logits"]
        n_acc, nxt = accept(logits, proposal.q, proposal.tokens, lengths, params, u_accept, u_next)
        verdict = _verdict(out, n_acc, nxt)
        if rules:
            emitted = [d[:n] + [t] for d, n, t in zip(proposal.tokens.tolist(), n_acc.tolist(), nxt.tolist())]
            verdict.logprobs = rules.logprobs(logits, emitted)
        return verdict

    def tree(self, batch: Batch, trees: list[DraftTree], params: RowParams, noise: torch.Tensor,
             verify_nodes: int | None = None) -> tuple[Verdict, list[list[int]]]:
        """Run every node of each row's tree in one pass (tree mask, depth positions); accept a path.
        Returns the verdict and each row's accepted path tokens (without the root)."""
        cache = batch.cache
        if verify_nodes is not None:
            trees = [rerank(t, verify_nodes) if params.greedy[b] else t for b, t in enumerate(trees)]
        ids, depth, mask = tree_tensors(trees, first=0, device=cache.lengths.device)
        cache.ensure(int(cache.lengths.max()) + ids.shape[1])
        rows = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
        out = self.target.outputs(ids, cache, rows, positions=cache.lengths[:, None] + depth, tree_mask=mask)
        logits = params.rules.apply_tree(out["logits"], trees) if params.rules else out["logits"]
        probs = None if params.all_greedy else probs_from_logits(logits, params.temperature, params.top_k, params.top_p)
        paths, nexts = [], []
        for b, tree in enumerate(trees):
            n = tree.size + 1
            if params.greedy[b]:
                path, nxt = accept_tree_greedy(logits[b, :n], tree)
            else:
                path, nxt = (accept_tree_fixed if tree.fixed else accept_tree_sampled)(probs[b, :n], tree, noise[b])
            paths.append(path)
            nexts.append(nxt)
        index, counts = pad_right(paths, cache.lengths.device)
        # further outputs (features for a draft head) in accepted-path order, like a chain's
        extra = {n: torch.gather(v, 1, index.view(*index.shape, *[1] * (v.dim() - 2)).expand(-1, -1, *v.shape[2:]))
                 for n, v in out.items() if n not in OWN_OUTPUTS}
        verdict = Verdict(counts - 1, torch.tensor(nexts, device=cache.lengths.device), out["new_k"], out["new_v"],
                          extra, index, trees=trees, tree_argmax=logits.argmax(-1).tolist())
        if params.rules:
            on_path = torch.gather(logits, 1, index[..., None].expand(-1, -1, logits.shape[-1]))
            emitted = [[tree.tokens[n] for n in p[1:]] + [t] for tree, p, t in zip(trees, paths, nexts)]
            verdict.logprobs = params.rules.logprobs(on_path, emitted)
        return verdict, [[tree.tokens[node] for node in path[1:]] for tree, path in zip(trees, paths)]


def _verdict(out: dict[str, torch.Tensor], n_accepted: torch.Tensor, next_token: torch.Tensor) -> Verdict:
    return Verdict(n_accepted, next_token, out["new_k"], out["new_v"], {n: v for n, v in out.items() if n not in OWN_OUTPUTS})
