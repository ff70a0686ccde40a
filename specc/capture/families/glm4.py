"""GLM-4: four norms (post-attention and post-MLP too), fused gate_up, partial interleaved rope."""
from .base import Family

FAMILY = Family(
    "glm4", "GLM-4", ("glm4",), post_attn_norm="post_self_attn_layernorm", post_mlp_norm="post_mlp_layernorm",
    interleaved_rope=True, notes="interleaved partial rope leaves the fused RotaryEmbedding operator",
    tiny={"head_dim": 16, "partial_rotary_factor": 0.5, "attention_bias": True},
)
