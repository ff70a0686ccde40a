"""The early-exit head: (trained adapter), the target's final norm and LM head after layer L.

One definition serves the add_early_exit pass (inside the draft graph) and `specc train-exit-head`
(on hidden states), so both compute the same logits. Adapters are stored as safetensors weights
plus metadata naming the layer and model.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from ..errors import ModelError


class ExitAdapter(nn.Module):
    """h + W2 silu(W1 rms_norm(h)): a small residual MLP trained by `specc train-exit-head`."""

    def __init__(self, hidden: int, rank: int, eps: float):
        super().__init__()
        self.norm_weight = nn.Parameter(torch.ones(hidden))
        self.w1 = nn.Linear(hidden, rank, bias=False)
        self.w2 = nn.Linear(rank, hidden, bias=False)
        self.eps = eps
        nn.init.zeros_(self.w2.weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = F.rms_norm(h.float(), (h.shape[-1],), self.norm_weight, self.eps).to(h.dtype)
        return h + self.w2(F.silu(self.w1(x)))


class ExitHead(nn.Module):
    """Hidden states [..., H] -> logits [..., V] float32: (adapter), final RMS norm (Gemma-style
    norms scale by offset + w), LM head; the target's own norm and head weights, shared."""

    def __init__(self, norm_weight: nn.Parameter, lm_head_weight: nn.Parameter, eps: float, offset: float,
                 adapter: ExitAdapter | None = None):
        super().__init__()
        self.norm_weight, self.lm_head_weight = norm_weight, lm_head_weight
        self.eps, self.offset, self.adapter = eps, offset, adapter

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.adapter is not None:
            h = self.adapter(h)
        weight = self.norm_weight.float() + self.offset if self.offset else self.norm_weight.float()
        h = F.rms_norm(h.float(), (h.shape[-1],), weight, self.eps).to(self.lm_head_weight.dtype)
        return F.linear(h, self.lm_head_weight).float()


def save_adapter(path: str | Path, adapter: ExitAdapter, layer: int, info: dict) -> None:
    meta = {"format": "specc-exit-adapter", "layer": str(layer), "hidden": str(adapter.w1.in_features),
            "rank": str(adapter.w1.out_features), "eps": repr(adapter.eps), "info": json.dumps(info)}
    save_file({k: v.detach().contiguous() for k, v in adapter.state_dict().items()}, str(path), metadata=meta)


def adapter_metadata(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"exit adapter {path} does not exist; make one with `specc train-exit-head`")
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
    except Exception as exc:  # safetensors raises several types for unreadable files
        raise ModelError(f"exit adapter {path} is not a readable safetensors file: {exc}") from None
    if meta.get("format") != "specc-exit-adapter":
        raise ModelError(f"{path} is not a specc exit adapter (no specc-exit-adapter metadata)")
    return meta


def load_adapter(path: str | Path, layer: int, hidden: int) -> ExitAdapter:
    """The adapter at path, checked to be trained for this exit layer and hidden size."""
    meta = adapter_metadata(path)
    if int(meta["layer"]) != layer or int(meta["hidden"]) != hidden:
        raise ModelError(f"exit adapter {path} was trained for layer {meta['layer']} of a model with hidden size "
                         f"{meta['hidden']}, but the recipe asks for layer {layer} with hidden size {hidden}")
    adapter = ExitAdapter(hidden, int(meta["rank"]), float(meta["eps"]))
    adapter.load_state_dict(load_file(str(path)))
    return adapter.eval()
