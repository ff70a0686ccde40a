"""Qwen3-MoE: Qwen3 attention (qk-norm), routed SwiGLU experts; dense MLP on mlp_only_layers."""
from ..blocks.moe import SwiGLUExperts
from .base import Family


def _mlp(mlp, config, i):
    if not hasattr(mlp, "experts"):  # a dense layer (mlp_only_layers / decoder_sparse_step)
        return mlp
    return SwiGLUExperts(mlp, config.num_experts_per_tok, renormalize=config.norm_topk_prob)


FAMILY = Family(
    "qwen3_moe", "Qwen3-MoE", ("qwen3_moe",), qk_norm="head", window="all", mlp=_mlp,
    notes="experts computed densely (all experts, zero weight where not routed)",
    tiny={"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
          "mlp_only_layers": [0], "norm_topk_prob": True},
)
