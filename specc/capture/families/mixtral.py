"""Mixtral: Mistral attention, top-k softmax-routed SwiGLU experts (renormalised)."""
from ..blocks.moe import SwiGLUExperts
from .base import Family

FAMILY = Family(
    "mixtral", "Mixtral", ("mixtral",), window="all",
    mlp=lambda mlp, config, i: SwiGLUExperts(mlp, config.num_experts_per_tok, renormalize=True),
    notes="experts computed densely (all experts, zero weight where not routed)",
    tiny={"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8},
)
