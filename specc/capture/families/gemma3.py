"""Gemma 3 (text): Gemma 2's layout plus qk-norm, its own rope base on sliding layers
(rope_local_base_freq), sliding/global pattern from layer_types."""
from .base import Family


def _problems(config) -> list[str]:
    if getattr(config, "use_bidirectional_attention", False):
        return ["unsupported attention variant: use_bidirectional_attention=True (an encoder, not a causal LM)"]
    return []


FAMILY = Family(
    "gemma3", "Gemma 3", ("gemma3_text",), norm_offset=1.0, qk_norm="head",
    post_attn_norm="post_attention_layernorm", pre_mlp_norm="pre_feedforward_layernorm",
    post_mlp_norm="post_feedforward_layernorm", window="layer_types", rope_per_layer_type=True,
    attn_softcap="attn_logit_softcapping", final_softcap="final_logit_softcapping",
    notes="text checkpoints (Gemma3ForCausalLM); local/global rope bases per layer type",
    tiny={"head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 16,
          "layer_types": ["sliding_attention", "full_attention"],
          "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                              "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}}},
    problems=_problems,
    real_checkpoints=("gemma3-270m",),
)
