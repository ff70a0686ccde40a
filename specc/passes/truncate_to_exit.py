"""truncate_to_exit: turn a graph with exit logits into a self-speculative draft graph made of the
target's first L layers.

requires: output exit_logits (add_early_exit ran).
ensures:  outputs logits (the exit logits), new_k, new_v for the first L layers only; k_cache and
  v_cache inputs of L layers; the later layers and the final LM head are gone from the graph.
  The first L layers are the target's own, so their KV equals the target's: the runtime lets
  this draft read the target's cache instead of keeping one.
"""
from __future__ import annotations

import dataclasses

from ..capture.graph import StepGraph
from .base import GraphPass, has_output, lacks_output


class TruncateToExit(GraphPass):
    """Keep only the layers below the exit: the draft graph of early-exit self-speculation."""

    name = "truncate_to_exit"
    requires = (has_output("exit_logits"),)
    ensures = (has_output("logits"), lacks_output("exit_logits"))

    def apply(self, graph: StepGraph) -> str:
        names = graph.outputs
        nodes = dict(zip(names, graph.output_nodes()))
        exit_logits = nodes["exit_logits"]
        n_keep = _exit_layer(graph)
        stacks = []
        for name in ("new_k", "new_v"):
            stack = nodes[name]
            with graph.gm.graph.inserting_before(stack):
                stacks.append(graph.gm.graph.call_function(stack.target, (list(stack.args[0][:n_keep]),) + tuple(stack.args[1:])))
        graph.set_outputs(["logits", "new_k", "new_v"], [exit_logits, *stacks])
        for spec in graph.inputs:
            if spec.name in ("k_cache", "v_cache"):
                spec.example = spec.example[:n_keep].clone()
                graph.placeholder(spec.name).meta["val"] = spec.example
        old = graph.dims.n_layers
        graph.dims = dataclasses.replace(graph.dims, n_layers=n_keep)
        return f"kept layers 0..{n_keep - 1} of {old}; outputs the exit logits"


def _exit_layer(graph: StepGraph) -> int:
    """How many layers feed the exit head (from the layer module its input leaves)."""
    (call,) = [n for n in graph.gm.graph.nodes if n.op == "call_module" and n.target == "exit_head"]
    stack = call.args[0].meta.get("nn_module_stack") or {}
    path = next(p for p, _ in reversed(list(stack.values())) if p.startswith("layers."))
    return int(path.split(".")[1]) + 1
