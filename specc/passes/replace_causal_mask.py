"""replace_causal_mask: the causal mask over the T new tokens becomes a `tree_mask` input.

requires: the captured CausalMask module in the graph; input position_ids (positions are the
  caller's, so a tree passes cache_len + depth).
ensures:  input tree_mask [B, T, T] bool: tree_mask[b, i, j] says new token i sees new token j
  (each node sees itself and its ancestors). The cache part of the mask is unchanged.
"""
from __future__ import annotations

import torch

from ..capture.graph import InputSpec, StepGraph
from .base import GraphPass, GraphProperty, has_input


def _mask_nodes(graph: StepGraph):
    """Nodes of the CausalMask module whose value leaves the module (its output)."""
    def inside(node) -> bool:
        stack = node.meta.get("nn_module_stack") or {}
        return any(path.endswith("causal_mask") for path, _ in stack.values())

    return [n for n in graph.gm.graph.nodes if inside(n) and any(not inside(u) for u in n.users)]


def _has_causal_mask(graph: StepGraph) -> bool:
    return len(_mask_nodes(graph)) == 1


class ReplaceCausalMask(GraphPass):
    """Verify a token tree in one pass: attention among new tokens comes from a tree_mask input."""

    name = "replace_causal_mask"
    requires = (GraphProperty("causal-mask", _has_causal_mask, "the captured causal mask"), has_input("position_ids"))
    ensures = (has_input("tree_mask"), GraphProperty("no-causal-mask", lambda g: not _mask_nodes(g), "no causal mask"))

    def apply(self, graph: StepGraph) -> str:
        (old,) = _mask_nodes(graph)
        ids = next(i.example for i in graph.inputs if i.name == "input_ids")
        b, t = ids.shape
        example = torch.tril(torch.ones(t, t, dtype=torch.bool, device=ids.device)).expand(b, t, t).clone()
        node = graph.add_input(InputSpec("tree_mask", example, {0: "batch", 1: "tokens", 2: "tokens"}))
        old.replace_all_uses_with(node)
        return "causal mask over new tokens replaced by input tree_mask [batch, tokens, tokens]"
