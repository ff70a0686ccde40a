"""OLMo 2: norms after attention and MLP (not before), qk-norm over the whole projection."""
from .base import Family

FAMILY = Family(
    "olmo2", "OLMo 2", ("olmo2",), pre_attn_norm=None, post_attn_norm="post_attention_layernorm",
    pre_mlp_norm=None, post_mlp_norm="post_feedforward_layernorm", qk_norm="projection",
    notes="post-norm layers, qk-norm before the head split",
)
