"""A bundle whose target computes acceptance in-graph gives exactly the host-side results."""
from __future__ import annotations

import pytest

import specc


@pytest.mark.parametrize("settings", [{}, {"temperature": 1.0}, {"temperature": 0.7, "top_k": 30, "top_p": 0.9}],
                         ids=["greedy", "t1.0", "t0.7-k30-p0.9"])
def test_in_graph_acceptance_equals_host(bundles, prompts, settings):
    host = specc.load(bundles["draft"])
    head = specc.load(bundles["verify_head"])
    assert head.verify_head and not host.verify_head
    chunk = prompts[:12]
    a = host.generate(chunk, max_new_tokens=20, k=3, seed=11, **settings)
    b = head.generate(chunk, max_new_tokens=20, k=3, seed=11, **settings)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert [c.stats["accepted"] for c in a] == [c.stats["accepted"] for c in b]


def test_verify_head_target_only_and_outputs(bundles, prompts):
    head = specc.load(bundles["verify_head"])
    host = specc.load(bundles["draft"])
    a = head.generate(prompts[:4], max_new_tokens=10, speculative=False)
    b = host.generate(prompts[:4], max_new_tokens=10, speculative=False)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    outputs = head.bundle.graph("target").outputs
    assert outputs == ["n_accepted", "next_token", "new_k", "new_v"], "no [B, T, V] logits leave the engine"
