"""The step graph: one forward over T new tokens against a read-only KV cache.

ABI (see docs/architecture.md), the same for every model family:

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
advances cache_len. The graph never writes an input, so every backend can run it. Every pass
gets S >= cache_len + T slots, so that a backend may attend over a copy of the cache with the
new tokens at their positions (onnx_passes/attend_at_cache_positions.py).

The decoder is assembled from the model's `Family` (capture/families/) over the Hugging Face
model's own submodules and weights (embedding, projections, MLPs, rotary frequencies).
Attention with an explicit cache is rewritten (capture/blocks/), as one
`scaled_dot_product_attention` call and RMSNorm as one `rms_norm` call wherever the family
allows, so that exporters lower each to one fused operator (ONNX opset 23 Attention and
RMSNormalization) instead of dozens of elementwise nodes.

Sliding windows are masks: slot s is visible to a query at position p when s > p - window.
The cache is not a ring buffer, so a window layer's cache holds every slot like a global one.
"""
from __future__ import annotations

import torch
from torch import nn

from ..errors import ModelError
from .blocks.attention import StepAttention
from .blocks.norms import StepRMSNorm, step_norm
from .blocks.rope import ropes_of
from .families import Family, family_for, supported_model_types

SUPPORTED_MODEL_TYPES = supported_model_types()

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


class StepLayer(nn.Module):
    """One decoder layer: x += r * post_attn(attn(pre_attn(x))); x += r * post_mlp(mlp(pre_mlp(x))).

    Absent norms are skipped (Llama has pre norms only, OLMo 2 post norms only, Gemma 2/3 and
    GLM-4 both); r is the residual multiplier (Granite) or 1.
    """

    def __init__(self, family: Family, config, index: int, hf_layer: nn.Module, attention: StepAttention):
        super().__init__()
        for slot in ("pre_attn_norm", "post_attn_norm", "pre_mlp_norm", "post_mlp_norm"):
            attr = getattr(family, slot)
            setattr(self, slot, step_norm(getattr(hf_layer, attr), family.norm_offset) if attr else None)
        self.self_attn = attention
        self.mlp = family.mlp(hf_layer.mlp, config, index) if family.mlp else hf_layer.mlp
        self.residual_multiplier = family.config_value(config, family.residual_multiplier)

    def residual(self, x, y, post):
        if post is not None:
            y = post(y)
        return x + (y * self.residual_multiplier if self.residual_multiplier is not None else y)

    def forward(self, x, cos, sin, mask, k_cache, v_cache):
        h = self.pre_attn_norm(x) if self.pre_attn_norm is not None else x
        attn, k, v = self.self_attn(h, cos, sin, mask, k_cache, v_cache)
        x = self.residual(x, attn, self.post_attn_norm)
        h = self.pre_mlp_norm(x) if self.pre_mlp_norm is not None else x
        x = self.residual(x, self.mlp(h), self.post_mlp_norm)
        return x, k, v


class StepDecoder(nn.Module):
    """A Hugging Face causal LM as a step graph (module docstring has the ABI)."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        cfg = hf_model.config
        family = family_for(cfg)
        self.family = family.name
        base = hf_model.model
        hf_layers = list(base.layers)
        self.n_layers = len(hf_layers)
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        head_dims = {int(getattr(layer.self_attn, "head_dim", 0)) for layer in hf_layers}
        if len(head_dims) != 1:
            raise ModelError(f"layers of this {family.title} model have head sizes {sorted(head_dims)}; the KV cache "
                             "[L, B, H, S, D] holds one head_dim for all layers")
        self.head_dim = head_dims.pop() or cfg.hidden_size // self.n_heads
        self.vocab_size = cfg.vocab_size
        self.windows = family.sliding_windows(cfg)[: self.n_layers]
        self.rope_keys = family.rope_keys(cfg)[: self.n_layers]
        use_rope = family.rope_layers(cfg) if family.rope_layers else [True] * self.n_layers

        self.embed_tokens = base.embed_tokens
        self.embedding_multiplier = family.config_value(cfg, family.embedding_multiplier)
        self.rotary = ropes_of(base.rotary_emb, cfg, family.interleaved_rope)
        self.rotary_fallback = ", ".join(
            ([f"partial ({self.rotary_dim()} of {self.head_dim} dims)"] if self.rotary_dim() < self.head_dim else [])
            + (["interleaved"] if family.interleaved_rope else [])
            + (["longrope per-token factors"] if any(r.long for r in self.rotary.values()) else []))
        self.causal_mask = CausalMask()
        softcap = family.config_value(cfg, family.attn_softcap)
        self.layers = nn.ModuleList(
            StepLayer(family, cfg, i, layer, StepAttention(
                layer.self_attn, self.n_heads, self.n_kv_heads, self.head_dim, fused_qkv=family.fused_qkv,
                qk_norm=family.qk_norm, norm_offset=family.norm_offset, use_rope=use_rope[i],
                interleaved_rope=family.interleaved_rope, softcap=softcap, sinks=family.sinks))
            for i, layer in enumerate(hf_layers)
        )
        self.norm = step_norm(base.norm, family.norm_offset)
        self.lm_head = hf_model.lm_head
        self.logits_divisor = family.config_value(cfg, family.logits_divisor)
        self.final_softcap = family.config_value(cfg, family.final_softcap)

    def rotary_dim(self) -> int:
        return 2 * int(next(iter(self.rotary.values())).inv_freq.shape[0])

    def capture_note(self) -> str:
        """Where this family's graph can use the fused opset-23 operators, and where it cannot (for inspect)."""
        norms = [m for m in self.modules() if isinstance(m, StepRMSNorm)]
        layer_norms = [m for m in self.modules() if isinstance(m, nn.LayerNorm)]
        rope_layers = [layer for layer in self.layers if layer.self_attn.use_rope]
        capped = [layer for layer in self.layers if layer.self_attn.softcap is not None]
        sites = [f"Attention {len(self.layers) - len(capped)}", f"RotaryEmbedding {2 * len(rope_layers)}",
                 f"RMSNormalization {len(norms)}" if norms else f"LayerNormalization {len(layer_norms)}"]
        why = []
        if capped:
            why.append(f"attention soft-capping is MatMul/Tanh/Softmax on {len(capped)} of {len(self.layers)} layers")
        if rope_layers and self.rotary_fallback:
            why.append(f"rope {self.rotary_fallback}: elementwise ops, no RotaryEmbedding")
        windows = sum(1 for w in self.windows if w)
        text = f"capture: family {self.family}; fused-operator sites: {', '.join(sites)}"
        text += f"; sliding window on {windows} of {len(self.layers)} layers (mask)" if windows else ""
        return text + (f"; fallbacks: {'; '.join(why)}" if why else "")

    def attention_mask(self, new_mask, position_ids, cache_len, cache_slots: int, window: int | None):
        """`[B, T, S+T]` bool: valid cache slots then `new_mask`, both inside the sliding window if any."""
        slots = torch.arange(cache_slots, device=cache_len.device)
        cache_mask = (slots[None, None, :] < cache_len[:, None, None]).expand(-1, position_ids.shape[1], -1)
        if window:
            cache_mask = cache_mask & (slots[None, None, :] > position_ids[:, :, None] - window)
            new_mask = new_mask & (position_ids[:, None, :] > position_ids[:, :, None] - window)
        return torch.cat([cache_mask, new_mask], dim=-1)

    def forward(self, input_ids, position_ids, cache_len, logit_index, k_cache, v_cache):
        x = self.embed_tokens(input_ids)
        if self.embedding_multiplier is not None:
            x = x * self.embedding_multiplier
        tables = {key: rope(position_ids, x.dtype) for key, rope in self.rotary.items()}
        causal = self.causal_mask(input_ids)
        masks = {w: self.attention_mask(causal, position_ids, cache_len, k_cache.shape[3], w) for w in set(self.windows)}
        new_k, new_v = [], []
        for i, layer in enumerate(self.layers):
            cos, sin = tables[self.rope_keys[i]]
            x, k, v = layer(x, cos, sin, masks[self.windows[i]], k_cache[i], v_cache[i])
            new_k.append(k)
            new_v.append(v)
        b, r = logit_index.shape
        picked = torch.gather(x, 1, logit_index[:, :, None].expand(b, r, x.shape[-1]))
        logits = self.lm_head(self.norm(picked)).float()
        if self.logits_divisor is not None:
            logits = logits / self.logits_divisor
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits, torch.stack(new_k), torch.stack(new_v)
