"""Norms as single fused calls: `rms_norm` (ONNX RMSNormalization) or the model's own LayerNorm."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class StepRMSNorm(nn.Module):
    """The model's RMSNorm as one `rms_norm` call, computed in float32.

    Gemma-style norms scale by (1 + w); `offset` carries that.
    """

    def __init__(self, hf_norm: nn.Module, offset: float = 0.0):
        super().__init__()
        self.weight = hf_norm.weight
        self.eps = float(getattr(hf_norm, "variance_epsilon", getattr(hf_norm, "eps", 1e-6)))
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.float() + self.offset if self.offset else self.weight.float()
        return F.rms_norm(x.float(), (x.shape[-1],), weight, self.eps).to(x.dtype)


def step_norm(hf_norm: nn.Module | None, offset: float = 0.0) -> nn.Module | None:
    """The step-graph version of a Hugging Face norm: LayerNorm is kept as is (it already lowers
    to one LayerNormalization), RMS norms become `StepRMSNorm`."""
    if hf_norm is None:
        return None
    if isinstance(hf_norm, nn.LayerNorm):
        return hf_norm
    return StepRMSNorm(hf_norm, offset)


def norm_facts(norm: nn.Module) -> dict:
    """What a head-adding pass needs to rebuild this final norm: kind, eps, offset."""
    if isinstance(norm, nn.LayerNorm):
        return {"norm_kind": "layer", "norm_eps": float(norm.eps), "norm_offset": 0.0}
    return {"norm_kind": "rms", "norm_eps": norm.eps, "norm_offset": norm.offset}
