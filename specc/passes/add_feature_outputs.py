"""add_feature_outputs: the target graph also returns the hidden features a learned draft head reads.

requires: outputs new_k (a step graph) and no features output yet; the captured layer modules
  (`layers.N`) and the final-norm facts (StepGraph.head).
ensures:  output features [B, T, F] for every one of the T new tokens (not only the logit_index
  rows: an EAGLE draft needs the features of every prompt token at prefill, and every accepted
  token afterwards). Without `layers`: the last layer's hidden state after the final norm,
  F = hidden (what the LM head reads; what Medusa and EAGLE-1/2 heads are trained on). With
  `layers` (EAGLE-3): the outputs of those layers before any norm, concatenated, F = len * hidden;
  with `projection` too (an EAGLE-3 head's fc weight [H', F]), that concatenation times it, F = H'
  (the head's fusion runs in the target graph, so the head reads one H'-wide feature per token).
  The features come from the same pass as the logits: no extra target pass.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..capture.graph import StepGraph
from .base import GraphPass, has_output, lacks_output


class FinalNorm(nn.Module):
    """The target's final norm over all new tokens, with its own weights (shared with the graph): RMSNorm
    (scaling by w, or by 1 + w where `offset` is 1), or LayerNorm where the family's norm has a bias."""

    def __init__(self, weight: nn.Parameter, eps: float, offset: float, bias: nn.Parameter | None = None):
        super().__init__()
        self.weight, self.bias, self.eps, self.offset = weight, bias, eps, offset

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            out = F.layer_norm(hidden.float(), (hidden.shape[-1],), self.weight.float(), self.bias.float(), self.eps)
            return out.to(hidden.dtype)
        weight = self.weight.float() + self.offset if self.offset else self.weight.float()
        return F.rms_norm(hidden.float(), (hidden.shape[-1],), weight, self.eps).to(hidden.dtype)


class AddFeatureOutputs(GraphPass):
    """Hidden features of every new token as an extra output, for Medusa and EAGLE heads."""

    name = "add_feature_outputs"
    requires = (has_output("new_k"), lacks_output("features"))
    ensures = (has_output("features"),)

    def __init__(self, layers: tuple[int, ...] | None = None, projection: torch.Tensor | None = None):
        self.layers = tuple(layers) if layers else None
        self.projection = projection

    def apply(self, graph: StepGraph) -> str:
        n_layers = graph.dims.n_layers
        gm = graph.gm
        out = graph.output_nodes()
        anchor = gm.graph.find_nodes(op="output")[0]
        if self.layers is None:
            facts = graph.head
            bias = gm.get_parameter("norm.bias") if facts.get("norm_kind") == "layer" else None
            gm.add_submodule("feature_norm", FinalNorm(gm.get_parameter("norm.weight"), facts["norm_eps"],
                                                       facts["norm_offset"], bias))
            hidden = graph.module_output(f"layers.{n_layers - 1}")
            with gm.graph.inserting_before(anchor):
                node = gm.graph.call_module("feature_norm", (hidden,))
            what = f"features: layer {n_layers} hidden state after the final norm, every new token"
        else:
            bad = [i for i in self.layers if not 0 <= i < n_layers]
            if bad:
                raise ValueError(f"feature layers must be in [0, {n_layers - 1}] for this {n_layers}-layer target, got {bad}")
            parts = [graph.module_output(f"layers.{i}") for i in self.layers]
            with gm.graph.inserting_before(anchor):
                node = gm.graph.call_function(torch.cat, (parts, -1))
            what = f"features: outputs of layers {', '.join(map(str, self.layers))} concatenated, every new token"
            if self.projection is not None:
                dtype = gm.get_parameter("norm.weight").dtype
                fc = nn.Linear(self.projection.shape[1], self.projection.shape[0], bias=False)
                fc.weight = nn.Parameter(self.projection.detach().to(dtype).clone(), requires_grad=False)
                gm.add_submodule("feature_fc", fc)
                with gm.graph.inserting_before(anchor):
                    node = gm.graph.call_module("feature_fc", (node,))
                what += f", fused by the head's fc ({self.projection.shape[1]} -> {self.projection.shape[0]})"
        graph.set_outputs(graph.outputs + ["features"], out + [node])
        return what
