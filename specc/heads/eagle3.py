"""The EAGLE-3 draft layer (Li et al. 2025) as a step graph, for published EAGLE-3 checkpoints.

EAGLE-3 reads the target's hidden states at three layers (low, middle, high), fused by `fc`
(3H -> H). specc puts that fusion in the target graph (add_feature_outputs with the head's fc),
so this graph reads H-wide features like EAGLE-1/2's and the runtime drafts with it the same way:
true entries get the fused target features, draft steps the layer's own output.

  e = input_layernorm(embed(x_{j+1}));  h = hidden_norm(f_j)
  r = f_j + attn([e; h]);  out = r + mlp(post_attention_layernorm(r))
  logits = lm_head(norm(out)) over the draft vocabulary (`d2t` maps it back to the target's)
`norm_before_residual` configs take hidden_norm(f_j) as the residual instead of f_j.
The graph's inputs and outputs are EAGLE-1/2's (heads/eagle.py).
"""
from __future__ import annotations

import torch
from torch import nn

from ..capture.step_decoder import CausalMask
from .eagle import MLP, EagleBase, HeadAttention, rms_norm
from .vocab import VocabMap


class Eagle3Layer(nn.Module):
    """EAGLE-3's `midlayer`: attention over [normed embedding; normed feature] (2H wide)."""

    def __init__(self, hidden: int, n_heads: int, n_kv_heads: int, head_dim: int, intermediate: int, eps: float,
                 bias: bool, norm_before_residual: bool):
        super().__init__()
        self.input_layernorm, self.hidden_norm = rms_norm(hidden, eps), rms_norm(hidden, eps)
        self.self_attn = HeadAttention(hidden, n_heads, n_kv_heads, head_dim, bias, in_width=2 * hidden)
        self.post_attention_layernorm = rms_norm(hidden, eps)
        self.mlp = MLP(hidden, intermediate)
        self.norm_before_residual = norm_before_residual

    def forward(self, embeds, features, cos, sin, mask, k_cache, v_cache):
        h = self.hidden_norm(features)
        x = torch.cat([self.input_layernorm(embeds), h], dim=-1)
        attn, k, v = self.self_attn(x, cos, sin, mask, k_cache, v_cache)
        r = (h if self.norm_before_residual else features) + attn
        return r + self.mlp(self.post_attention_layernorm(r)), k, v


class Eagle3Head(EagleBase):
    """An EAGLE-3 draft bound to its target (the target's embedding and rotary tables, frozen).

    `feature_layers`: the target layers whose outputs `fc` fuses (EAGLE-3's aux layer ids name the
    layer whose input is taken, so these are those ids minus one)."""

    def __init__(self, target: nn.Module, config: dict, draft_vocab: torch.Tensor | None, feature_layers: tuple[int, ...]):
        super().__init__()
        cfg = target.config
        hidden = cfg.hidden_size
        n_heads = int(config.get("num_attention_heads", cfg.num_attention_heads))
        n_kv = int(config.get("num_key_value_heads") or n_heads)
        head_dim = int(config.get("head_dim") or hidden // n_heads)
        self.n_kv_heads, self.head_dim, self.hidden = n_kv, head_dim, hidden
        self.feature_layers = tuple(feature_layers)
        self.embed_tokens = target.model.embed_tokens
        self.rotary_emb = target.model.rotary_emb
        self.causal_mask = CausalMask()
        self.fc = nn.Linear(len(self.feature_layers) * hidden, hidden, bias=False)
        eps = float(config.get("rms_norm_eps", 1e-6))
        self.midlayer = Eagle3Layer(hidden, n_heads, n_kv, head_dim, int(config["intermediate_size"]), eps,
                                    bool(config.get("attention_bias", False)), bool(config.get("norm_before_residual", False)))
        self.norm = rms_norm(hidden, eps)
        rows = cfg.vocab_size if draft_vocab is None else len(draft_vocab)
        self.lm_head = nn.Linear(hidden, rows, bias=False)
        self.vocab = VocabMap(draft_vocab, cfg.vocab_size)

    def layer_step(self, input_ids, features, position_ids, mask, k_cache, v_cache):
        """The midlayer over (embed(ids), features) with an explicit mask [B, T, S+T] (EagleHead.layer_step)."""
        features = features.to(self.fc.weight.dtype)
        cos, sin = self.rotary_emb(features, position_ids)
        return self.midlayer(self.embed_tokens(input_ids), features, cos, sin, mask, k_cache, v_cache)

    def reduced_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))


def default_feature_layers(n_layers: int) -> tuple[int, ...]:
    """The target layers EAGLE-3 fuses by default: the inputs of layers (2, L // 2, L - 3), as vLLM takes
    them, i.e. the outputs of layers (1, L // 2 - 1, L - 4); clamped into the target for shallow ones."""
    return tuple(min(max(i - 1, 0), n_layers - 2 if n_layers > 1 else 0) for i in (2, n_layers // 2, n_layers - 3))


def fresh_eagle3(target: nn.Module, draft_vocab: torch.Tensor | None, feature_layers: tuple[int, ...]) -> Eagle3Head:
    """An untrained EAGLE-3 head shaped after the target: its LM head starts as the target's rows (the draft
    vocabulary's) and its final norm as the target's, so it starts out reading features as the target does."""
    cfg = target.config
    config = {"num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": getattr(cfg, "num_key_value_heads", None),
              "head_dim": getattr(cfg, "head_dim", None), "intermediate_size": cfg.intermediate_size,
              "rms_norm_eps": getattr(cfg, "rms_norm_eps", 1e-6),
              "attention_bias": bool(getattr(cfg, "attention_bias", cfg.model_type == "qwen2"))}
    head = Eagle3Head(target, config, draft_vocab, feature_layers)
    with torch.no_grad():
        rows = target.lm_head.weight if draft_vocab is None else target.lm_head.weight[draft_vocab]
        head.lm_head.weight.copy_(rows)
        head.norm.weight.copy_(target.model.norm.weight)
    return head

