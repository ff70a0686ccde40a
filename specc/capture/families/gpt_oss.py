"""GPT-OSS: attention sinks, alternating sliding/global layers, yarn rope, biased top-k router
(softmax over the chosen logits), clamped SwiGLU experts with interleaved gate/up."""
from __future__ import annotations

import torch
from torch import nn

from ..blocks.moe import dense_weights
from .base import Family


class GptOssExperts(nn.Module):
    def __init__(self, hf_mlp: nn.Module, config):
        super().__init__()
        self.router_weight, self.router_bias = hf_mlp.router.weight, hf_mlp.router.bias
        e = hf_mlp.experts
        self.gate_up_proj, self.gate_up_proj_bias = e.gate_up_proj, e.gate_up_proj_bias  # [E, H, 2I], [E, 2I]
        self.down_proj, self.down_proj_bias = e.down_proj, e.down_proj_bias  # [E, I, H], [E, H]
        self.alpha, self.limit, self.top_k = e.alpha, e.limit, config.num_experts_per_tok

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        flat = x.reshape(-1, h)
        logits = torch.nn.functional.linear(flat, self.router_weight, self.router_bias)
        top, index = torch.topk(logits, self.top_k, dim=-1)
        weights = dense_weights(torch.softmax(top, dim=-1), index, self.gate_up_proj.shape[0])
        gate_up = torch.einsum("nh,eho->neo", flat, self.gate_up_proj) + self.gate_up_proj_bias
        gate = gate_up[..., ::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        act = (up + 1) * gate * torch.sigmoid(gate * self.alpha)
        out = torch.einsum("nei,eih->neh", act, self.down_proj) + self.down_proj_bias
        return (out * weights[:, :, None]).sum(dim=1).reshape(b, t, h)


def _problems(config) -> list[str]:
    if getattr(config, "quantization_config", None):
        return ["unsupported weights: MXFP4-quantised experts; dequantise the checkpoint to bf16/fp32 first"]
    return []


FAMILY = Family(
    "gpt_oss", "GPT-OSS", ("gpt_oss",), window="layer_types", sinks=True, mlp=lambda mlp, config, i: GptOssExperts(mlp, config),
    problems=_problems,
    notes="sinks as a zero key slot biased by the sink logit (stays on SDPA); experts computed densely",
    tiny={"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8,
          "layer_types": ["sliding_attention", "full_attention"]},
    hf_attention="eager",
)
