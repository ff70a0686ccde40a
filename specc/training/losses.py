"""The losses draft heads train on: Medusa's cross-entropy per head, EAGLE's unrolled draft steps (smooth-L1 to
the target's features and cross-entropy), all against the target's top-K over the draft vocabulary."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..heads.eagle import EagleBase
from ..heads.eagle3 import Eagle3Head
from ..heads.medusa import MedusaHeads

def soft_targets(top_val, top_idx, to_draft: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Renormalised top-K target probabilities over draft-vocabulary indices (-1 marks tokens outside it)."""
    p = torch.softmax(top_val.float(), -1)
    idx = top_idx.long() if to_draft is None else to_draft[top_idx.long()]
    p = torch.where(idx >= 0, p, 0.0)
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-9)
    return p, idx.clamp_min(0)


def _ce(logits, p, idx, mask) -> torch.Tensor:
    logq = torch.log_softmax(logits.float(), -1).gather(-1, idx)
    loss = -(p * logq).sum(-1)
    return (loss * mask).sum() / mask.sum().clamp_min(1)


def medusa_loss(head: MedusaHeads, batch: dict, to_draft) -> torch.Tensor:
    feats = batch["features"].float()
    logits = head.reduced_logits(feats)  # [b, T, N, V']
    total = 0.0
    for i in range(head.n_heads):
        shift = 1 + i
        p, idx = soft_targets(batch["top_val"][:, shift:], batch["top_idx"][:, shift:], to_draft)
        mask = (batch["valid"][:, shift:] & batch["valid"][:, :-shift]).float()
        total = total + _ce(logits[:, :-shift, i], p, idx, mask)
    return total / head.n_heads


def eagle_unroll(head: EagleBase, tokens: torch.Tensor, features: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The head's outputs of `steps` draft steps from every position at once: out[s][:, o] [B, T-1-s, H]
    predicts the feature s + 1 tokens after o, drafting from round o (training-time test, as in HASS
    and EAGLE-3).

    Step 1 at entry o = (x_{o+1}, f_o) sees entries 0..o, as when a round enters the committed
    tokens. Step s > 1 is drafting as the runtime drafts: its entry (x_{o+s}, h) at position o+s-1
    feeds the head's own output h of step s-1 at o and attends to the true entries 0..o and to round
    o's earlier draft entries only."""
    b, t = tokens.shape[0], tokens.shape[1] - 1
    causal = torch.tril(torch.ones(t, t, dtype=torch.bool))
    eye = torch.eye(t, dtype=torch.bool)
    keys, values, out, f_in = [], [], [], features[:, :t]
    for s in range(min(steps, t)):
        n = t - s  # rounds o = 0..n-1 have a target s + 1 tokens on
        mask = torch.cat([causal[:n, :n]] + [eye[:n, :n]] * s, dim=-1)  # true entries <= o, then round o's own
        if keys:
            k_cache, v_cache = (torch.cat([x[:, :, :n] for x in kv], dim=2) for kv in (keys, values))
        else:
            k_cache = v_cache = head.empty_cache(b)[0]
        h, k, v = head.layer_step(tokens[:, 1 + s:], f_in[:, :n], torch.arange(s, s + n)[None].expand(b, n),
                                  mask[None].expand(b, -1, -1), k_cache, v_cache)
        keys.append(k)
        values.append(v)
        out.append(h)
        f_in = h
    return out


def eagle_loss(head: EagleBase, batch: dict, to_draft, noise: float, unroll: int = 1) -> torch.Tensor:
    """Per draft step of `eagle_unroll`: smooth-L1 to the target's feature (EAGLE-1/2 only) + 0.5 x
    cross-entropy against its distribution, step s weighted 0.8^(s-1); Gaussian noise on step 1's input
    features (EAGLE-3: on the layers' features, before fc)."""
    feats = batch["features"].float()
    f_in = feats[:, :-1]
    if noise:
        f_in = f_in + torch.randn_like(f_in) * noise * f_in.pow(2).mean().sqrt()
    fused = isinstance(head, Eagle3Head)
    total, weight = 0.0, 0.0
    for s, h in enumerate(eagle_unroll(head, batch["tokens"], head.fc(f_in) if fused else f_in, unroll)):
        m = batch["valid"][:, 1 + s:].float()
        loss = 0.0 if fused else (F.smooth_l1_loss(h.float(), feats[:, 1 + s:], reduction="none").mean(-1) * m).sum() / m.sum().clamp_min(1)
        p, idx = soft_targets(batch["top_val"][:, 1 + s:], batch["top_idx"][:, 1 + s:], to_draft)
        total = total + 0.8 ** s * (loss + 0.5 * _ce(head.reduced_logits(h), p, idx, m))
        weight += 0.8 ** s
    return total / weight
