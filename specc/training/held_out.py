"""Held-out greedy acceptance of a head being trained: drafting chains from spaced positions (`acceptance`) and in
rounds as a greedy run makes them (`round_acceptance`), on answers the target wrote."""
from __future__ import annotations

import torch

from ..heads.eagle import EagleBase
from ..heads.eagle3 import Eagle3Head
from ..heads.medusa import MedusaHeads

@torch.no_grad()
def acceptance(head, data: dict, rows: torch.Tensor, depth: int, starts: int = 6) -> list[float]:
    """Greedy acceptance by draft position on held-out sequences: P(drafts 1..i all equal the target argmax).

    A round starting at o: the target has processed x_0..x_o and x_{o+1} is pending; draft i stands
    for x_{o+1+i} and must equal the target's argmax at o+i. That argmax was computed on the data's
    context, so rounds start only where the data continues as the target's greedy choice for the
    next depth-1 tokens (`answer`; every position of a generated answer).
    """
    hits, total = torch.zeros(depth), 0
    argmax = data["top_idx"][..., 0].long()
    for r in rows.tolist():
        n = int(data["valid"][r].sum())
        ok = data["answer"][r, :n].long()
        if n < depth + 3:
            continue
        span = ok[2:].unfold(0, depth - 1, 1).prod(-1) if depth > 1 else ok[2:]
        candidates = [o for o in span.nonzero()[:, 0].tolist() if o + depth < n]
        chosen = candidates[::max(1, len(candidates) // starts)][:starts]
        if not chosen:
            continue
        drafts = _drafter(head, data, r, max(chosen) + 1)
        for o in chosen:
            target = argmax[r, o + 1:o + 1 + depth]
            drafted = drafts(o, depth)
            hit = (drafted == target[:len(drafted)]).long().cumprod(-1)
            hits[:len(hit)] += hit.float()
            total += 1
    return (hits / max(total, 1)).tolist()


@torch.no_grad()
def round_acceptance(head, data: dict, rows: torch.Tensor, k: int) -> tuple[list[float], int]:
    """Greedy acceptance by draft position in chain rounds of k drafts over the answers, as a greedy
    run counts it (the bench's `acceptance_by_position`): the first round starts where the answer
    does, each next one after the accepted drafts and the target's own token. Rounds start after a
    miss more often than spaced positions do, so this is below `acceptance` and closer to what a
    benchmark measures. Returns (acceptance by position, rounds)."""
    argmax = data["top_idx"][..., 0].long()
    hits, rounds = torch.zeros(k), 0
    for r in rows.tolist():
        n = int(data["valid"][r].sum())
        o = n - int(data["answer"][r, :n].sum()) - 1  # the prompt's last position: its next token is the answer's first
        if o < 0 or o + k >= n:
            continue
        drafts = _drafter(head, data, r, n - k)
        while o + k < n:  # the target's argmax is known up to position n - 1
            hit = (drafts(o, k) == argmax[r, o + 1:o + 1 + k]).long().cumprod(-1)
            hits += hit.float()
            rounds += 1
            o += int(hit.sum()) + 1
    return (hits / max(rounds, 1)).tolist(), rounds


def _drafter(head, data: dict, r: int, n: int):
    """draft(o, k): the head's k greedy drafts for a round of row r starting at o < n."""
    if isinstance(head, MedusaHeads):
        return lambda o, k: head(data["features"][r, o].float())[:k].argmax(-1)
    entered = _eagle_enter(head, data, r, n)
    return lambda o, k: _eagle_chain(head, entered, o, k)


def _eagle_enter(head: EagleBase, data: dict, r: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row r's first n true entries (x_{j+1}, f_j) in one pass: outputs [1, n, H] and KV ([1, 1, H_kv, n, D]).
    Entry o's output and the cache up to it are what a round starting at o has (attention is causal)."""
    feats = data["features"][r:r + 1, :n].float()
    if isinstance(head, Eagle3Head):  # the target graph fuses them (passes/add_feature_outputs.py)
        feats = head.fc(feats)
    empty = head.empty_cache(1)
    return head.run(data["tokens"][r:r + 1, 1:n + 1], feats, torch.arange(n)[None], torch.zeros(1, dtype=torch.long),
                    empty, empty)


def _eagle_chain(head: EagleBase, entered: tuple, o: int, depth: int) -> torch.Tensor:
    """Draft `depth` tokens autoregressively from round o with the head's own cache, as the runtime does."""
    h, k, v = entered[0][:, o:o + 1], entered[1][..., :o + 1, :], entered[2][..., :o + 1, :]
    logits = head.vocab(head.reduced_logits(h))
    out = []
    for i in range(depth):
        tok = logits[:, 0].argmax(-1)
        out.append(tok)
        if i + 1 == depth:
            break
        logits, h, nk, nv = head(tok[:, None], h[:, -1:], torch.tensor([[o + 1 + i]]), torch.tensor([k.shape[3]]),
                                 torch.zeros(1, 1, dtype=torch.long), k, v)
        k, v = torch.cat([k, nk], 3), torch.cat([v, nv], 3)
    return torch.cat(out)
