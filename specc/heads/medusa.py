"""Medusa heads (Cai et al. 2024) as a graph over the target's features.

Features are the target's last hidden state after its final norm (what its LM head reads and what
published Medusa heads were trained on). Head i maps the feature at position j through `layers`
residual blocks x + silu(W x + b) and an LM head (its own, or the target's shared rows) to a
distribution over token j+2+i.
  graph inputs:  features [B, R, H]
  graph outputs: logits   [B, R, N, V] float32
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .vocab import VocabMap


class ResBlock(nn.Module):
    """Medusa's residual block: x + silu(linear(x)), the linear starting at zero (identity)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """N Medusa heads; `lm_heads` None means every head shares the (frozen) target LM head rows."""

    def __init__(self, hidden: int, n_heads: int, n_layers: int, lm_head_weight: torch.Tensor, vocab_size: int,
                 draft_vocab: torch.Tensor | None = None, shared_lm_head: bool = True):
        super().__init__()
        rows = lm_head_weight if draft_vocab is None else lm_head_weight[draft_vocab]
        self.heads = nn.ModuleList(nn.Sequential(*(ResBlock(hidden) for _ in range(n_layers))) for _ in range(n_heads))
        if shared_lm_head:
            self.shared = nn.Parameter(rows.detach().clone(), requires_grad=False)
            self.lm_heads = None
        else:
            self.shared = None
            self.lm_heads = nn.ModuleList(nn.Linear(hidden, rows.shape[0], bias=False) for _ in range(n_heads))
            with torch.no_grad():
                for lin in self.lm_heads:
                    lin.weight.copy_(rows)
        self.vocab = VocabMap(draft_vocab, vocab_size)
        self.n_heads = n_heads

    def reduced_logits(self, features: torch.Tensor) -> torch.Tensor:
        """[..., N, V'] logits over the draft vocabulary (training reads these)."""
        outs = []
        for i, head in enumerate(self.heads):
            h = head(features)
            outs.append(F.linear(h, self.shared) if self.lm_heads is None else self.lm_heads[i](h))
        return torch.stack(outs, dim=-2)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.vocab(self.reduced_logits(features))
