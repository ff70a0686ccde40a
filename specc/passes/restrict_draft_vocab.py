"""restrict_draft_vocab: the draft's LM head keeps the rows of a subset of the vocabulary (`draft.vocab`), so each draft
step reads a fraction of the largest matrix of a small model's pass.

A 0.5B draft of a 150k-token family spends about a quarter of its weights on the LM head. Restricted to the
tokenizer's first ids (byte-level BPE numbers tokens by merge order, roughly by frequency) and its special tokens, as
FR-Spec does with measured frequencies, the head rarely loses the token the full head would have drafted. The graph's
`logits` then hold the kept ids' columns in order; the runtime puts them back at their ids with every other token at
-inf (a probability of zero), so greedy drafting and the rejection rule see a draft distribution over the whole
vocabulary, and output stays exact whatever the draft proposes.

requires: output logits computed by a linear LM head (through casts and elementwise logit scaling only).
ensures:  output logits over the kept ids only, in ascending id order.
"""
from __future__ import annotations

import operator

import torch

from ..capture.graph import StepGraph
from ..errors import ModelError
from .base import GraphPass, has_output

WEIGHT = "restricted_lm_head_weight"


def _lm_head(graph: StepGraph):
    """The linear node that computes the logits (the output reached back through casts and logit scaling) and its
    weight's node; a tied head's weight is the embedding's, which the restricted head stops sharing."""
    node = dict(zip(graph.outputs, graph.output_nodes()))["logits"]
    for _ in range(16):
        if node.op == "call_function" and node.target == torch.ops.aten.linear.default:
            return node, node.args[1]
        inputs = [a for a in node.args if isinstance(a, torch.fx.Node)]
        if node.op != "call_function" or len(inputs) != 1:
            break
        node = inputs[0]
    raise ModelError("draft.vocab: the draft graph's logits do not come from a linear LM head (through casts and "
                     "logit scaling only), which is what restrict_draft_vocab can restrict; leave draft.vocab out")


class RestrictDraftVocab(GraphPass):
    """Keep the LM head's rows of `ids` (ascending token ids)."""

    name = "restrict_draft_vocab"
    requires = (has_output("logits"),)
    ensures = (has_output("logits"),)

    def __init__(self, ids: list[int]):
        self.ids = ids

    def apply(self, graph: StepGraph) -> str:
        linear, weight = _lm_head(graph)
        if weight.op != "get_attr":
            raise ModelError("draft.vocab: the draft graph's LM head weight is not a constant of the graph; leave "
                             "draft.vocab out")
        full = operator.attrgetter(weight.target)(graph.gm)
        rows = torch.nn.Parameter(full.detach()[torch.tensor(self.ids)].clone(), requires_grad=False)
        graph.gm.register_parameter(WEIGHT, rows)
        with graph.gm.graph.inserting_before(linear):
            kept = graph.gm.graph.get_attr(WEIGHT)
        kept.meta["val"] = rows
        linear.args = (linear.args[0], kept, *linear.args[2:])
        graph.gm.graph.eliminate_dead_code()
        graph.gm.recompile()
        graph.exported = None
        graph.vocab_ids = list(self.ids)
        return f"LM head restricted to {len(self.ids)} of {full.shape[0]} token ids"
