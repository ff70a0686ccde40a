"""insert_verify_head: acceptance inside the target graph, so only [B]-sized results leave it.

requires: output logits (read at positions 0..K of the verified tokens: pending + K drafts);
  no tree_mask (tree acceptance is not a prefix rule).
ensures:  inputs draft_tokens [B, K] int64, draft_probs [B, K, V] float32, n_draft [B] int64,
  temperature [B] float32, top_k [B] int64, top_p [B] float32, u_accept [B, K] float32,
  u_next [B] float32; outputs n_accepted [B] int64, next_token [B] int64, new_k, new_v; no logits.
  Per row: greedy rows (temperature 0) accept the longest prefix equal to the target argmax;
  others use modified rejection sampling with the given noise. The computation is the
  runtime's own (speculation/sampling.py), so results equal host-side acceptance for the same noise.
  With n_draft = 0 the head samples the next token from position 0: prefill and plain decode.
"""
from __future__ import annotations

import operator

import torch
from torch import nn

from ..capture.graph import InputSpec, StepGraph
from ..limits import MAX_K
from ..speculation.sampling import accept_greedy, accept_sampled, probs_from_logits
from .base import GraphPass, has_input, has_output, lacks_output


class VerifyHead(nn.Module):
    def forward(self, logits, draft_tokens, draft_probs, n_draft, temperature, top_k, top_p, u_accept, u_next):
        n_g, next_g = accept_greedy(logits, draft_tokens, n_draft)
        p = probs_from_logits(logits, temperature, top_k, top_p)
        n_s, next_s = accept_sampled(p, draft_probs, draft_tokens, n_draft, u_accept, u_next)
        greedy = temperature == 0
        return torch.where(greedy, n_g, n_s), torch.where(greedy, next_g, next_s)


HEAD_INPUTS = ("draft_tokens", "draft_probs", "n_draft", "temperature", "top_k", "top_p", "u_accept", "u_next")


class InsertVerifyHead(GraphPass):
    """Acceptance in the graph: greedy match or rejection sampling against the draft's probabilities."""

    name = "insert_verify_head"
    requires = (has_output("logits"), lacks_output("n_accepted"))
    ensures = (has_output("n_accepted"), has_output("next_token"), lacks_output("logits"),
               *(has_input(n) for n in HEAD_INPUTS))

    def apply(self, graph: StepGraph) -> str:
        if any(i.name == "tree_mask" for i in graph.inputs):
            raise ValueError("the verification head accepts chains; it cannot follow replace_causal_mask")
        ids = next(i.example for i in graph.inputs if i.name == "input_ids")
        b, t = ids.shape
        k, vocab, dev = t - 1, graph.dims.vocab_size, ids.device
        examples = {
            "draft_tokens": (torch.randint(0, vocab, (b, k), device=dev), {0: "batch", 1: "draft"}),
            "draft_probs": (torch.softmax(torch.randn(b, k, vocab, device=dev), -1), {0: "batch", 1: "draft"}),
            "n_draft": (torch.full((b,), k, dtype=torch.long, device=dev), {0: "batch"}),
            "temperature": ((torch.arange(b, device=dev) % 2).float(), {0: "batch"}),  # greedy and sampled rows
            "top_k": (torch.zeros(b, dtype=torch.long, device=dev), {0: "batch"}),
            "top_p": (torch.ones(b, device=dev), {0: "batch"}),
            "u_accept": (torch.rand(b, k, device=dev), {0: "batch", 1: "draft"}),
            "u_next": (torch.rand(b, device=dev), {0: "batch"}),
        }
        graph.ranges.extra.setdefault("draft", (1, MAX_K))
        head_inputs = [graph.add_input(InputSpec(name, ex, dims)) for name, (ex, dims) in examples.items()]
        graph.gm.add_submodule("verify_head", VerifyHead())
        nodes = dict(zip(graph.outputs, graph.output_nodes()))
        with graph.gm.graph.inserting_before(graph.gm.graph.find_nodes(op="output")[0]):
            call = graph.gm.graph.call_module("verify_head", (nodes["logits"], *head_inputs))
            n_acc = graph.gm.graph.call_function(operator.getitem, (call, 0))
            nxt = graph.gm.graph.call_function(operator.getitem, (call, 1))
        rest = [n for n in graph.outputs if n not in ("logits", "new_k", "new_v")]  # e.g. features for a draft head
        graph.set_outputs(["n_accepted", "next_token", "new_k", "new_v", *rest],
                          [n_acc, nxt, nodes["new_k"], nodes["new_v"], *(nodes[n] for n in rest)])
        return "acceptance in graph: outputs n_accepted, next_token [batch] instead of logits [batch, rows, vocab]"

