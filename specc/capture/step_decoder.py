"""The step graph: one forward over T new tokens against a read-only KV cache.

ABI (see docs/architecture.md):

inputs
  input_ids    [B, T]  int64   new tokens (right-padded per row)
  position_ids [B, T]  int64   their positions (cache_len + offset, or cache_len + depth in a tree)
  cache_len    [B]     int64   valid cache slots per row
  logit_index  [B, R]  int64   which of the T positions get logits (all for verify, last for prefill)
  k_cache      [L, B, H, S, D] read only
  v_cache      [L, B, H, S, D] read only
outputs
  logits       [B, R, V] float32
  new_k        [L, B, H, T, D] keys of the T new tokens
  new_v        [L, B, H, T, D] values of the T new tokens

The runtime owns the cache: it copies the accepted tokens' new_k/new_v into it and
advances cache_len. The graph never writes an input, so every backend can run it.

The module reuses the Hugging Face model's own submodules and weights (embedding, MLPs,
projections, rotary tables). Attention with an explicit cache is rewritten here, and
attention and RMSNorm are written as `scaled_dot_product_attention` and `rms_norm` so that
exporters can lower each to one fused operator (ONNX opset 23 Attention and
RMSNormalization) instead of dozens of elementwise nodes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma")

INPUT_NAMES = ("input_ids", "position_ids", "cache_len", "logit_index", "k_cache", "v_cache")
OUTPUT_NAMES = ("logits", "new_k", "new_v")


class CausalMask(nn.Module):
    """Causal attention among the T new tokens, `[B, T, T]` bool.

    Kept as its own module so that passes can find (and replace) it by module path.
    """

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        b, t = input_ids.shape
        ones = torch.ones(t, t, dtype=torch.bool, device=input_ids.device)
        return torch.tril(ones).unsqueeze(0).expand(b, t, t)


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


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class StepAttention(nn.Module):
    """Grouped-query attention over `[cache ; new]` keys with an explicit mask."""

    def __init__(self, hf_attn: nn.Module, n_heads: int, n_kv_heads: int, head_dim: int, norm_offset: float):
        super().__init__()
        self.q_proj, self.k_proj = hf_attn.q_proj, hf_attn.k_proj
        self.v_proj, self.o_proj = hf_attn.v_proj, hf_attn.o_proj
        self.q_norm = StepRMSNorm(hf_attn.q_norm, norm_offset) if hasattr(hf_attn, "q_norm") else None
        self.k_norm = StepRMSNorm(hf_attn.k_norm, norm_offset) if hasattr(hf_attn, "k_norm") else None
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.scale = getattr(hf_attn, "scaling", head_dim**-0.5)

    def forward(self, x, cos, sin, mask, k_cache, v_cache):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin

        keys = torch.cat([k_cache, k], dim=2)  # [B, Hkv, S+T, D]
        values = torch.cat([v_cache, v], dim=2)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None], scale=self.scale,
                                             enable_gqa=self.n_heads != self.n_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)), k, v


class StepLayer(nn.Module):
    """One pre-norm decoder layer around the model's own norms and MLP."""

    def __init__(self, hf_layer: nn.Module, n_heads: int, n_kv_heads: int, head_dim: int, norm_offset: float):
        super().__init__()
        self.input_layernorm = StepRMSNorm(hf_layer.input_layernorm, norm_offset)
        self.post_attention_layernorm = StepRMSNorm(hf_layer.post_attention_layernorm, norm_offset)
        self.self_attn = StepAttention(hf_layer.self_attn, n_heads, n_kv_heads, head_dim, norm_offset)
        self.mlp = hf_layer.mlp

    def forward(self, x, cos, sin, mask, k_cache, v_cache):
        attn, k, v = self.self_attn(self.input_layernorm(x), cos, sin, mask, k_cache, v_cache)
        x = x + attn
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, k, v


class StepDecoder(nn.Module):
    """A Hugging Face causal LM as a step graph (module docstring has the ABI)."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        cfg = hf_model.config
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelError(
                f"model_type {cfg.model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        base = hf_model.model
        self.n_layers = cfg.num_hidden_layers
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.vocab_size = cfg.vocab_size
        self.sliding_window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
        self.embed_tokens = base.embed_tokens
        self.rotary_emb = base.rotary_emb
        self.causal_mask = CausalMask()
        offset = 1.0 if cfg.model_type == "gemma" else 0.0
        self.layers = nn.ModuleList(
            StepLayer(layer, self.n_heads, self.n_kv_heads, self.head_dim, offset) for layer in base.layers
        )
        self.norm = StepRMSNorm(base.norm, offset)
        self.lm_head = hf_model.lm_head

    def attention_mask(self, new_mask, position_ids, cache_len, cache_slots: int):
        """`[B, T, S+T]` bool: valid cache slots (inside the sliding window) then `new_mask`."""
        slots = torch.arange(cache_slots, device=cache_len.device)
        cache_mask = (slots[None, None, :] < cache_len[:, None, None]).expand(-1, position_ids.shape[1], -1)
        if self.sliding_window:
            cache_mask = cache_mask & (slots[None, None, :] > position_ids[:, :, None] - self.sliding_window)
        return torch.cat([cache_mask, new_mask], dim=-1)

    def forward(self, input_ids, position_ids, cache_len, logit_index, k_cache, v_cache):
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(x, position_ids)
        mask = self.attention_mask(self.causal_mask(input_ids), position_ids, cache_len, k_cache.shape[3])
        new_k, new_v = [], []
        for i, layer in enumerate(self.layers):
            x, k, v = layer(x, cos, sin, mask, k_cache[i], v_cache[i])
            new_k.append(k)
            new_v.append(v)
        b, r = logit_index.shape
        picked = torch.gather(x, 1, logit_index[:, :, None].expand(b, r, x.shape[-1]))
        logits = self.lm_head(self.norm(picked)).float()
        return logits, torch.stack(new_k), torch.stack(new_v)
