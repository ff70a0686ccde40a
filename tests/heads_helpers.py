"""Untrained Medusa / EAGLE heads with random weights for tiny targets: partly right by chance,
which is what the lossless checks need (drafts both accepted and rejected)."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from specc.heads.store import build_head, save_head


def make_random_head(kind: str, target: Path, path: Path, seed: int = 0, scale: float = 0.3, **kwargs) -> Path:
    hf = AutoModelForCausalLM.from_pretrained(target).eval()
    torch.manual_seed(seed)
    head = build_head(kind, hf, **kwargs)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.requires_grad and p.dim() > 1:
                p.normal_(0.0, scale / p.shape[1] ** 0.5)
    return save_head(path, head, hf, card={"kind": kind, "random": True})
