"""add_early_exit: exit logits after the first `layer` layers (final norm + LM head, optionally a
trained adapter in between), as a new output.

requires: outputs logits; the captured layer modules and final-norm facts (StepGraph.head).
ensures:  output exit_logits [B, R, V] float32, read at the same logit_index as logits.
"""
from __future__ import annotations

import torch
from torch import nn

from ..capture.graph import StepGraph
from ..heads.exit import ExitAdapter, ExitHead
from .base import GraphPass, has_output


class GatherExitHead(nn.Module):
    """The exit head at the logit_index positions only."""

    def __init__(self, head: ExitHead):
        super().__init__()
        self.head = head

    def forward(self, hidden: torch.Tensor, logit_index: torch.Tensor) -> torch.Tensor:
        b, r = logit_index.shape
        return self.head(torch.gather(hidden, 1, logit_index[:, :, None].expand(b, r, hidden.shape[-1])))


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
        head = GatherExitHead(ExitHead(gm.get_parameter("norm.weight"), gm.get_parameter("lm_head.weight"),
                                       graph.head["norm_eps"], graph.head["norm_offset"], self.adapter))
        gm.add_submodule("exit_head", head)
        hidden = graph.module_output(f"layers.{self.layer - 1}")
        index = graph.placeholder("logit_index")
        out = graph.output_nodes()
        with gm.graph.inserting_before(gm.graph.find_nodes(op="output")[0]):
            node = gm.graph.call_module("exit_head", (hidden, index))
        graph.set_outputs(graph.outputs + ["exit_logits"], out + [node])
        return f"exit logits after layer {self.layer} of {n_layers}" + (" with a trained adapter" if self.adapter else "")
