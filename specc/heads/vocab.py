"""Reduced draft vocabularies (EAGLE-3 style): a head predicts V' frequent tokens, mapped back to
the target's vocabulary inside the graph. Logits outside the draft vocabulary are the float32
minimum, so q is exactly zero there and rejection sampling stays exact."""
from __future__ import annotations

import torch
from torch import nn

NEG = torch.finfo(torch.float32).min


class VocabMap(nn.Module):
    """Reduced draft vocabulary → full-vocabulary logits (minimum float outside the draft vocabulary)."""

    def __init__(self, draft_vocab: torch.Tensor | None, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.register_buffer("draft_vocab", None if draft_vocab is None else draft_vocab.long().clone())

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        if self.draft_vocab is None:
            return logits
        full = torch.full((*logits.shape[:-1], self.vocab_size), NEG, dtype=logits.dtype, device=logits.device)
        index = self.draft_vocab.expand(*logits.shape[:-1], -1)
        return full.scatter(-1, index, logits)
