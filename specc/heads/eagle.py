"""The EAGLE-1/2 draft layer (Li et al. 2024) as a step graph with its own KV cache.

One decoder layer over fc([embed(x_{j+1}); f_j]) predicts the target's next feature f_{j+1}
(the post-norm last hidden state); the target's LM head rows (or a reduced draft vocabulary)
read it. The layer's output is fed back as the feature of the next draft step.
  graph inputs:  input_ids, features [B, T, H], position_ids, cache_len, logit_index,
                 k_cache, v_cache ([1, B, H_kv, S, D])
  graph outputs: logits [B, R, V] float32, hidden [B, T, H], new_k, new_v ([1, B, H_kv, T, D])
The causal mask over the T new tokens is the step decoder's CausalMask module, so the
replace_causal_mask pass turns the graph into a tree drafter.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from ..capture.step_decoder import CausalMask, StepAttention, StepRMSNorm
from .vocab import VocabMap


def rms_norm(hidden: int, eps: float) -> StepRMSNorm:
    return StepRMSNorm(SimpleNamespace(weight=nn.Parameter(torch.ones(hidden)), variance_epsilon=eps))


class HeadAttention(StepAttention):
    """The step graph's attention with its own projections (input width may differ from the output's)."""

    def __init__(self, hidden: int, n_heads: int, n_kv_heads: int, head_dim: int, bias: bool, in_width: int | None = None):
        width = in_width or hidden
        projections = SimpleNamespace(q_proj=nn.Linear(width, n_heads * head_dim, bias=bias),
                                      k_proj=nn.Linear(width, n_kv_heads * head_dim, bias=bias),
                                      v_proj=nn.Linear(width, n_kv_heads * head_dim, bias=bias),
                                      o_proj=nn.Linear(n_heads * head_dim, hidden, bias=False), scaling=head_dim ** -0.5)
        super().__init__(projections, n_heads, n_kv_heads, head_dim, fused_qkv=False, qk_norm=None, norm_offset=0.0,
                         use_rope=True, interleaved_rope=False, softcap=None, sinks=False)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class EagleLayer(nn.Module):
    """EAGLE's decoder layer: as the target's, without the input norm (its input is fc's output)."""

    def __init__(self, hidden: int, n_heads: int, n_kv_heads: int, head_dim: int, intermediate: int, eps: float,
                 bias: bool):
        super().__init__()
        self.self_attn = HeadAttention(hidden, n_heads, n_kv_heads, head_dim, bias)
        self.post_attention_layernorm = rms_norm(hidden, eps)
        self.mlp = MLP(hidden, intermediate)

    def forward(self, x, cos, sin, mask, k_cache, v_cache):
        attn, k, v = self.self_attn(x, cos, sin, mask, k_cache, v_cache)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), k, v


class EagleBase(nn.Module):
    """What EAGLE-1/2 and EAGLE-3 heads share: the step graph's signature around `layer_step` and
    `reduced_logits`, the cache mask, and the attributes the graph capture and runtime read."""

    n_kv_heads: int
    head_dim: int
    hidden: int
    vocab: VocabMap
    fc: nn.Linear

    def attention_mask(self, new_mask, cache_len, cache_slots: int):
        slots = torch.arange(cache_slots, device=cache_len.device)
        cache_mask = (slots[None, None, :] < cache_len[:, None, None]).expand(-1, new_mask.shape[1], -1)
        return torch.cat([cache_mask, new_mask], dim=-1)

    def run(self, input_ids, features, position_ids, cache_len, k_cache, v_cache):
        """Hidden states [B, T, H] and the new KV ([1, B, H_kv, T, D] each)."""
        mask = self.attention_mask(self.causal_mask(input_ids), cache_len, k_cache.shape[3])
        h, k, v = self.layer_step(input_ids, features, position_ids, mask, k_cache[0], v_cache[0])
        return h, k[None], v[None]

    def forward(self, input_ids, features, position_ids, cache_len, logit_index, k_cache, v_cache):
        h, new_k, new_v = self.run(input_ids, features, position_ids, cache_len, k_cache, v_cache)
        b, r = logit_index.shape
        picked = torch.gather(h, 1, logit_index[:, :, None].expand(b, r, h.shape[-1]))
        return self.vocab(self.reduced_logits(picked)), h, new_k, new_v

    def empty_cache(self, batch: int) -> torch.Tensor:
        return torch.zeros(1, batch, self.n_kv_heads, 0, self.head_dim, dtype=self.fc.weight.dtype)


class EagleHead(EagleBase):
    """The EAGLE-1/2 draft: embed + fc + one decoder layer + LM head, as a step graph (module docstring)."""

    def __init__(self, target: nn.Module, draft_vocab: torch.Tensor | None = None, fc_bias: bool = True):
        super().__init__()
        cfg = target.config
        hidden = cfg.hidden_size
        n_heads = cfg.num_attention_heads
        n_kv = getattr(cfg, "num_key_value_heads", None) or n_heads
        head_dim = getattr(cfg, "head_dim", None) or hidden // n_heads
        self.n_kv_heads, self.head_dim, self.hidden = n_kv, head_dim, hidden
        self.vocab_size = cfg.vocab_size
        self.embed_tokens = target.model.embed_tokens  # frozen, the target's
        self.rotary_emb = target.model.rotary_emb
        self.causal_mask = CausalMask()
        self.fc = nn.Linear(2 * hidden, hidden, bias=fc_bias)
        eps = float(getattr(cfg, "rms_norm_eps", 1e-6))
        bias = bool(getattr(cfg, "attention_bias", cfg.model_type == "qwen2"))
        self.layers = nn.ModuleList([EagleLayer(hidden, n_heads, n_kv, head_dim, cfg.intermediate_size, eps, bias)])
        rows = target.lm_head.weight if draft_vocab is None else target.lm_head.weight[draft_vocab]
        self.lm_head = nn.Parameter(rows.detach().clone(), requires_grad=False)
        self.vocab = VocabMap(draft_vocab, cfg.vocab_size)

    def trainable(self) -> list[nn.Parameter]:
        return list(self.fc.parameters()) + list(self.layers.parameters())

    def layer_step(self, input_ids, features, position_ids, mask, k_cache, v_cache):
        """The layer over fc([embed(ids); features]) with an explicit mask [B, T, S+T] over cache
        ([B, H_kv, S, D]) and new entries: hidden states and the new entries' KV ([B, H_kv, T, D])."""
        x = self.fc(torch.cat([self.embed_tokens(input_ids), features.to(self.fc.weight.dtype)], dim=-1))
        cos, sin = self.rotary_emb(x, position_ids)
        return self.layers[0](x, cos, sin, mask, k_cache, v_cache)

    def reduced_logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.lm_head)
