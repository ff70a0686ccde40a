"""add_early_exit: exit logits after the first `layer` layers (final norm + LM head, optionally a
trained adapter in between), as a new output.

requires: outputs logits; the captured layer modules and final-norm facts (StepGraph.head).
ensures:  output exit_logits [B, R, V] float32, read at the same logit_index as logits.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..capture.graph import StepGraph
from .base import GraphPass, has_output


class ExitAdapter(nn.Module):
    """h + W2 silu(W1 rms_norm(h)): a small residual MLP trained by `specc train-exit-head`."""

    def __init__(self, hidden: int, rank: int, eps: float):
        super().__init__()
        self.norm_weight = nn.Parameter(torch.ones(hidden))
        self.w1 = nn.Linear(hidden, rank, bias=False)
        self.w2 = nn.Linear(rank, hidden, bias=False)
        self.eps = eps
        nn.init.zeros_(self.w2.weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = F.rms_norm(h.float(), (h.shape[-1],), self.norm_weight, self.eps).to(h.dtype)
        return h + self.w2(F.silu(self.w1(x)))


class ExitHead(nn.Module):
    """Gather the requested positions, then (adapter), final norm and LM head: the target's own head."""

    def __init__(self, norm_weight: nn.Parameter, lm_head_weight: nn.Parameter, eps: float, offset: float,
                 adapter: ExitAdapter | None, norm_bias: nn.Parameter | None = None, logits_divisor: float | None = None,
                 final_softcap: float | None = None):
        super().__init__()
        self.norm_weight, self.lm_head_weight, self.norm_bias = norm_weight, lm_head_weight, norm_bias
        self.eps, self.offset, self.adapter = eps, offset, adapter
        self.logits_divisor, self.final_softcap = logits_divisor, final_softcap

    def forward(self, hidden: torch.Tensor, logit_index: torch.Tensor) -> torch.Tensor:
        b, r = logit_index.shape
        h = torch.gather(hidden, 1, logit_index[:, :, None].expand(b, r, hidden.shape[-1]))
        if self.adapter is not None:
            h = self.adapter(h)
        if self.norm_bias is not None:  # a LayerNorm family (StarCoder2)
            h = F.layer_norm(h, (h.shape[-1],), self.norm_weight, self.norm_bias, self.eps)
        else:
            weight = self.norm_weight.float() + self.offset if self.offset else self.norm_weight.float()
            h = F.rms_norm(h.float(), (h.shape[-1],), weight, self.eps).to(hidden.dtype)
        logits = F.linear(h, self.lm_head_weight).float()
        if self.logits_divisor is not None:
            logits = logits / self.logits_divisor
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


class AddEarlyExit(GraphPass):
    """Exit logits after layer L (final norm + LM head, optional trained adapter): a self-speculative head."""

    name = "add_early_exit"
    requires = (has_output("logits"),)
    ensures = (has_output("exit_logits"),)

    def __init__(self, layer: int, adapter: ExitAdapter | None = None):
        self.layer, self.adapter = layer, adapter

    def apply(self, graph: StepGraph) -> str:
        n_layers = graph.dims.n_layers
        if not 1 <= self.layer < n_layers:
            raise ValueError(f"draft.layer must be in [1, {n_layers - 1}] for this {n_layers}-layer target, got {self.layer}")
        gm = graph.gm
        facts = graph.head
        bias = gm.get_parameter("norm.bias") if facts.get("norm_kind") == "layer" else None
        head = ExitHead(gm.get_parameter("norm.weight"), gm.get_parameter("lm_head.weight"), facts["norm_eps"],
                        facts["norm_offset"], self.adapter, bias, facts.get("logits_divisor"), facts.get("final_softcap"))
        gm.add_submodule("exit_head", head)
        hidden = graph.module_output(f"layers.{self.layer - 1}")
        index = graph.placeholder("logit_index")
        out = graph.output_nodes()
        with gm.graph.inserting_before(gm.graph.find_nodes(op="output")[0]):
            node = gm.graph.call_module("exit_head", (hidden, index))
        graph.set_outputs(graph.outputs + ["exit_logits"], out + [node])
        return f"exit logits after layer {self.layer} of {n_layers}" + (" with a trained adapter" if self.adapter else "")
