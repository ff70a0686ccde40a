"""Mixture-of-experts blocks as ordinary ops: top-k routing becomes dense per-expert weights
(zero for unchosen experts) and every expert runs on every token.

That is exact and exports to any backend (TopK, ScatterElements, Einsum), at E/k times the
expert FLOPs of a sparse kernel: right for the small MoE drafts and tests specc targets,
wasteful for a large MoE target (noted in `specc models check`).
"""
from __future__ import annotations

import torch
from torch import nn


def dense_weights(top_values: torch.Tensor, top_index: torch.Tensor, n_experts: int) -> torch.Tensor:
    """[N, k] routing weights at [N, k] expert ids -> [N, E] with zeros elsewhere."""
    dense = torch.zeros(top_values.shape[0], n_experts, dtype=top_values.dtype, device=top_values.device)
    return dense.scatter(1, top_index, top_values)


class SwiGLUExperts(nn.Module):
    """Mixtral / Qwen3-MoE: softmax over experts, top-k, optional renormalisation; experts
    act(gate) * up with `gate_up_proj [E, 2I, H]` and `down_proj [E, H, I]`."""

    def __init__(self, hf_block: nn.Module, top_k: int, renormalize: bool):
        super().__init__()
        self.router_weight = hf_block.gate.weight
        self.gate_up_proj, self.down_proj = hf_block.experts.gate_up_proj, hf_block.experts.down_proj
        self.act = hf_block.experts.act_fn
        self.top_k, self.renormalize = top_k, renormalize

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        flat = x.reshape(-1, h)
        probs = torch.softmax(torch.nn.functional.linear(flat, self.router_weight).float(), dim=-1)
        top, index = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            top = top / top.sum(dim=-1, keepdim=True)
        weights = dense_weights(top.to(x.dtype), index, self.gate_up_proj.shape[0])
        gate, up = torch.einsum("nh,eoh->neo", flat, self.gate_up_proj).chunk(2, dim=-1)
        out = torch.einsum("nei,ehi->neh", self.act(gate) * up, self.down_proj)
        return (out * weights[:, :, None]).sum(dim=1).reshape(b, t, h)
