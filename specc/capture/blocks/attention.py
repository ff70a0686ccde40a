"""Grouped-query attention over `[cache ; new]` keys with an explicit mask.

The common case is one `scaled_dot_product_attention` call (ONNX opset 23 `Attention`).
Attention sinks (GPT-OSS) stay on that call: a zero key/value slot whose mask bias is the
head's sink logit adds exp(sink) to the softmax denominator and nothing to the output.
Logit soft-capping (Gemma 2) has no SDPA form, so those layers use matmul/tanh/softmax.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .norms import step_norm
from .rope import rotate


class StepAttention(nn.Module):
    """One attention layer around the model's own projections (separate or fused qkv) and qk-norms.

    qk_norm: None, "head" (per head, after the head split: Qwen3, Gemma 3) or "projection"
    (over the whole projection, before the split: OLMo 2).
    """

    def __init__(self, hf_attn: nn.Module, n_heads: int, n_kv_heads: int, head_dim: int, *, fused_qkv: bool,
                 qk_norm: str | None, norm_offset: float, use_rope: bool, interleaved_rope: bool,
                 softcap: float | None, sinks: bool):
        super().__init__()
        if fused_qkv:
            self.qkv_proj = hf_attn.qkv_proj
        else:
            self.q_proj, self.k_proj, self.v_proj = hf_attn.q_proj, hf_attn.k_proj, hf_attn.v_proj
        self.o_proj = hf_attn.o_proj
        self.fused_qkv = fused_qkv
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm, self.k_norm = step_norm(hf_attn.q_norm, norm_offset), step_norm(hf_attn.k_norm, norm_offset)
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.scale = float(getattr(hf_attn, "scaling", head_dim**-0.5))
        self.use_rope, self.interleaved_rope = use_rope, interleaved_rope
        self.softcap = softcap
        self.sinks = hf_attn.sinks if sinks else None

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.fused_qkv:
            q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
            q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        b, t, _ = x.shape
        q = q.view(b, t, self.n_heads, self.head_dim)
        k = k.view(b, t, self.n_kv_heads, self.head_dim)
        v = v.view(b, t, self.n_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, x, cos, sin, mask, k_cache, v_cache):
        b, t, _ = x.shape
        q, k, v = self.project(x)
        if self.use_rope:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            q = rotate(q, cos, sin, self.interleaved_rope)
            k = rotate(k, cos, sin, self.interleaved_rope)
        keys = torch.cat([k_cache, k], dim=2)  # [B, Hkv, S+T, D]
        values = torch.cat([v_cache, v], dim=2)
        if self.softcap is not None:
            out = self.softcapped(q, keys, values, mask)
        elif self.sinks is not None:
            out = self.with_sinks(q, keys, values, mask)
        else:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None], scale=self.scale,
                                                 enable_gqa=self.n_heads != self.n_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)), k, v

    def with_sinks(self, q, keys, values, mask):
        b, _, t, _ = q.shape
        zero = keys.new_zeros(b, self.n_kv_heads, 1, self.head_dim)
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
        sink = self.sinks.to(q.dtype)[None, :, None, None].expand(b, self.n_heads, t, 1)
        bias = torch.cat([sink, bias[:, None].expand(b, self.n_heads, t, -1)], dim=-1)
        out = F.scaled_dot_product_attention(q, torch.cat([zero, keys], dim=2), torch.cat([zero, values], dim=2),
                                             attn_mask=bias, scale=self.scale, enable_gqa=self.n_heads != self.n_kv_heads)
        # the eager CPU kernel returns a [B, T, H, D] memory layout, the decomposed one [B, H, T, D]: fix it, so
        # the head merge after this traces as a copy that is valid for both
        return out.clone(memory_format=torch.contiguous_format)

    def softcapped(self, q, keys, values, mask):
        groups = self.n_heads // self.n_kv_heads
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
        scores = torch.matmul(q, keys.transpose(2, 3)) * self.scale
        scores = torch.tanh(scores / self.softcap) * self.softcap
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
        return torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), values)
