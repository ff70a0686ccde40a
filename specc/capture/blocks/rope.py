"""Rotary position tables and their application, from the Hugging Face rotary module's own
inverse frequencies (so every rope variant HF initialises — default, linear, llama3, yarn,
longrope, partial rotary — is covered by one formula)."""
from __future__ import annotations

import torch
from torch import nn

from ...errors import ModelError

# rope types whose frequencies are fixed at load time (dynamic NTK recomputes them from the
# sequence length inside the forward: data-dependent, not expressible in one graph)
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "proportional")


class Rope(nn.Module):
    """`cos, sin [B, T, rotary_dim]` for positions `[B, T]`.

    longrope: the short factors below `original_max_position_embeddings`, the long ones above,
    chosen per token (HF chooses once per forward from the largest position: the same for
    one-token decode steps, but it would make a verify pass depend on how tokens are grouped).
    `interleaved`: pairs (0,1), (2,3)... rotate together (GLM) instead of the two halves.
    """

    def __init__(self, inv_freq: torch.Tensor, scaling: float, interleaved: bool = False,
                 long_inv_freq: torch.Tensor | None = None, original_max: int | None = None):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.float().clone(), persistent=False)
        self.long = long_inv_freq is not None
        if self.long:
            self.register_buffer("long_inv_freq", long_inv_freq.float().clone(), persistent=False)
        self.original_max = original_max
        self.scaling = float(scaling)
        self.interleaved = interleaved

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        pos = position_ids[..., None].float()
        inv_freq = self.inv_freq
        if self.long:
            inv_freq = torch.where(pos + 1 > self.original_max, self.long_inv_freq, self.inv_freq)
        freqs = pos * inv_freq
        emb = freqs.repeat_interleave(2, dim=-1) if self.interleaved else torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.scaling, emb.sin() * self.scaling
        return cos.to(dtype), sin.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Apply rotary tables `[B, 1, T, R]` to the first R dims of `x [B, H, T, D]` (R < D: partial rotary)."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        x, rest = x[..., :rot], x[..., rot:]
    else:
        rest = None
    if interleaved:
        turned = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    else:
        half = x.shape[-1] // 2
        turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    out = x * cos + turned * sin
    return out if rest is None else torch.cat((out, rest), dim=-1)


def ropes_of(hf_rotary: nn.Module, config, interleaved: bool) -> nn.ModuleDict:
    """One `Rope` per rope key: "default", or each layer type when the model keeps one table per
    layer type (Gemma 3: local and global bases)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    per_type = isinstance(getattr(hf_rotary, "rope_type", None), dict)
    keys = sorted(hf_rotary.rope_type) if per_type else ["default"]
    out = nn.ModuleDict()
    for key in keys:
        prefix = f"{key}_" if per_type else ""
        rope_type = hf_rotary.rope_type[key] if per_type else hf_rotary.rope_type
        params = config.rope_parameters[key] if per_type else config.rope_parameters
        if rope_type not in STATIC_ROPE_TYPES:
            raise ModelError(f"rope type {rope_type!r} is not supported (its frequencies change with the sequence "
                             f"length inside the forward); supported: {', '.join(STATIC_ROPE_TYPES)}")
        inv_freq = getattr(hf_rotary, f"{prefix}original_inv_freq", getattr(hf_rotary, f"{prefix}inv_freq"))
        scaling = getattr(hf_rotary, f"{prefix}attention_scaling")
        long_inv, original_max = None, None
        if rope_type == "longrope":
            original_max = int(params["original_max_position_embeddings"])
            kwargs = {"layer_type": key} if per_type else {}
            long_inv, _ = ROPE_INIT_FUNCTIONS["longrope"](config, inv_freq.device, seq_len=original_max + 1, **kwargs)
        out[key] = Rope(inv_freq, scaling, interleaved, long_inv, original_max)
    return out
