"""Gemma 2: pre and post norms around attention and MLP, alternating sliding/global layers,
attention logit soft-capping, final logit soft-capping, query_pre_attn_scalar scaling."""
from .base import Family

FAMILY = Family(
    "gemma2", "Gemma 2", ("gemma2",), norm_offset=1.0,
    post_attn_norm="post_attention_layernorm", pre_mlp_norm="pre_feedforward_layernorm",
    post_mlp_norm="post_feedforward_layernorm", window="layer_types",
    attn_softcap="attn_logit_softcapping", final_softcap="final_logit_softcapping",
    notes="attention soft-capping leaves the fused Attention operator (matmul/tanh/softmax)",
    tiny={"head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 16, "attn_logit_softcapping": 5.0,
          "final_logit_softcapping": 3.0},
    hf_attention="eager",
)
