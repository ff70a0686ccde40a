"""One focused test per graph pass, on a tiny model: contract, rewrite, and numerics after re-export."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from specc.capture.shapes import dim_ranges
from specc.capture.graph import capture
from specc.passes import PassContractError
from specc.passes.replace_causal_mask import ReplaceCausalMask
from specc.testing import make_tiny_model


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path_factory.mktemp("m") / "m", seed=3)).eval()


def _run(module, ids, pos, cache_len, index, k, v, *extra):
    with torch.no_grad():
        return module(ids, pos, cache_len, index, k, v, *extra)


def test_replace_causal_mask_verifies_a_tree_like_its_paths(hf):
    graph = capture("target", hf, dim_ranges(4, 64))
    ReplaceCausalMask()(graph)
    assert graph.inputs[-1].name == "tree_mask"
    from specc.passes.base import PASS_TAG

    assert graph.placeholder("tree_mask").meta["custom"][PASS_TAG] == "replace_causal_mask"
    program = graph.export().module()
    dims = graph.dims
    # context of 5 tokens in the cache, then a tree: root r; children a, b of r; c child of a
    torch.manual_seed(0)
    context = torch.randint(0, 256, (1, 5))
    tokens = torch.tensor([[10, 20, 30, 40]])  # r, a, b, c
    parent = [-1, 0, 0, 1]
    depth = torch.tensor([[0, 1, 1, 2]])
    mask = torch.zeros(1, 4, 4, dtype=torch.bool)
    for i in range(4):
        j = i
        while j >= 0:
            mask[0, i, j] = True
            j = parent[j]
    empty = torch.zeros(dims.n_layers, 1, dims.n_kv_heads, 0, dims.head_dim)
    causal5 = torch.tril(torch.ones(5, 5, dtype=torch.bool))[None]
    _, k, v = _run(program, context, torch.arange(5)[None], torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long), empty, empty, causal5)
    tree_logits, _, _ = _run(program, tokens, 5 + depth, torch.tensor([5]), torch.arange(4)[None], k, v, mask)
    for node in range(4):
        path = []
        j = node
        while j >= 0:
            path.insert(0, tokens[0, j].item())
            j = parent[j]
        seq = torch.cat([context, torch.tensor([path])], 1)
        ref = hf(seq).logits[0, -1]
        assert (tree_logits[0, node] - ref).abs().max() < 1e-4, node


def test_replace_causal_mask_contract(hf):
    graph = capture("target", hf, dim_ranges(4, 64))
    assert graph.export() is graph.exported is not None  # unedited: backends lower the capture itself
    ReplaceCausalMask()(graph)
    assert graph.exported is None  # an edited graph is traced again before lowering
    with pytest.raises(PassContractError, match="requires the captured causal mask"):
        ReplaceCausalMask()(graph)


def _exit_reference(hf, ids, layer):
    """Final norm + LM head applied to the hidden state after `layer` layers (Hugging Face's own modules)."""
    with torch.no_grad():
        hidden = hf(ids, output_hidden_states=True).hidden_states[layer]
        return hf.lm_head(hf.model.norm(hidden))


def test_add_early_exit_adds_exit_logits(hf):
    from specc.passes.add_early_exit import AddEarlyExit

    graph = capture("target", hf, dim_ranges(4, 64))
    AddEarlyExit(layer=1)(graph)
    assert graph.outputs == ["logits", "new_k", "new_v", "exit_logits"]
    program = graph.export().module()
    ids = torch.randint(0, 256, (2, 6))
    dims = graph.dims
    empty = torch.zeros(dims.n_layers, 2, dims.n_kv_heads, 0, dims.head_dim)
    logits, _, _, exit_logits = _run(program, ids, torch.arange(6).expand(2, 6), torch.zeros(2, dtype=torch.long),
                                     torch.arange(6).expand(2, 6), empty, empty)
    assert (exit_logits - _exit_reference(hf, ids, 1)).abs().max() < 1e-4
    assert (logits - hf(ids).logits).abs().max() < 1e-4


def test_truncate_to_exit_builds_a_draft_of_the_first_layers(hf):
    from specc.passes.add_early_exit import AddEarlyExit
    from specc.passes.truncate_to_exit import TruncateToExit

    target = capture("target", hf, dim_ranges(4, 64))
    draft = capture("draft", hf, dim_ranges(4, 64))
    AddEarlyExit(layer=1)(draft)
    TruncateToExit()(draft)
    assert draft.dims.n_layers == 1 and draft.outputs == ["logits", "new_k", "new_v"]
    assert not any(n.meta.get("nn_module_stack") and any(p.startswith("layers.1") for p, _ in n.meta["nn_module_stack"].values())
                   for n in draft.gm.graph.nodes), "later layers must be gone"
    program = draft.export().module()
    ids = torch.randint(0, 256, (1, 5))
    d = draft.dims
    empty = torch.zeros(1, 1, d.n_kv_heads, 0, d.head_dim)
    logits, k, v = _run(program, ids, torch.arange(5)[None], torch.zeros(1, dtype=torch.long), torch.arange(5)[None], empty, empty)
    assert (logits - _exit_reference(hf, ids, 1)).abs().max() < 1e-4
    full = target.export().module()
    empty2 = torch.zeros(target.dims.n_layers, 1, d.n_kv_heads, 0, d.head_dim)
    _, k_t, _ = _run(full, ids, torch.arange(5)[None], torch.zeros(1, dtype=torch.long), torch.arange(5)[None], empty2, empty2)
    assert torch.allclose(k, k_t[:1], atol=1e-5), "the draft's KV is the target's first-layer KV"


def test_early_exit_layer_out_of_range(hf):
    from specc.errors import RecipeError
    from specc.passes.add_early_exit import AddEarlyExit

    graph = capture("target", hf, dim_ranges(4, 64))
    with pytest.raises(RecipeError, match=r"draft.layer': must be in \[1, 1\]"):
        AddEarlyExit(layer=2)(graph)


def test_insert_verify_head_equals_host_acceptance(hf):
    from specc.passes.insert_verify_head import InsertVerifyHead
    from specc.speculation.sampling import RowParams, SamplingParams, accept

    plain = capture("target", hf, dim_ranges(4, 64))
    graph = capture("target", hf, dim_ranges(4, 64))
    InsertVerifyHead()(graph)
    assert graph.outputs == ["n_accepted", "next_token", "new_k", "new_v"]
    head = graph.export().module()
    ref = plain.export().module()
    torch.manual_seed(5)
    b, k, dims = 4, 3, graph.dims
    cache = torch.randn(dims.n_layers, b, dims.n_kv_heads, 6, dims.head_dim)
    ids = torch.randint(0, 256, (b, k + 1))
    pos = 6 + torch.arange(k + 1).expand(b, -1)
    lens = torch.full((b,), 6)
    rows = torch.arange(k + 1).expand(b, -1)
    logits, _, _ = _run(ref, ids, pos, lens, rows, cache, cache)
    draft = logits[:, :k].argmax(-1)
    draft[1, 1] = (draft[1, 1] + 1) % 256  # a greedy rejection
    q = torch.softmax(torch.randn(b, k, logits.shape[-1]), -1)
    params = RowParams.of([SamplingParams(0.0), SamplingParams(0.0), SamplingParams(1.0), SamplingParams(0.7, 20, 0.9)])
    n_draft = torch.tensor([3, 3, 2, 3])
    u = torch.rand(b, k + 1)
    want = accept(logits, q, draft, n_draft, params, u[:, :k], u[:, k])
    n_acc, nxt, _, _ = _run(head, ids, pos, lens, rows, cache, cache, draft, q, n_draft, params.temperature,
                            params.top_k, params.top_p, u[:, :k], u[:, k])
    assert n_acc.tolist() == want[0].tolist() and nxt.tolist() == want[1].tolist()
    assert n_acc[1] == 1


def test_add_feature_outputs_returns_every_tokens_features(hf):
    from specc.passes.add_feature_outputs import AddFeatureOutputs

    ids = torch.randint(0, 256, (2, 7))
    last = []  # the last layer's output before the final norm (HF's hidden_states end with the normed one)
    hook = hf.model.layers[1].register_forward_hook(lambda m, a, out: last.append(out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        ref = hf.model(ids, output_hidden_states=True)
    hook.remove()
    dims = None
    fc = torch.randn(hf.config.hidden_size, 3 * hf.config.hidden_size) * 0.1  # an EAGLE-3 head's fusion
    fused = torch.cat([ref.hidden_states[1], last[0], ref.hidden_states[1]], -1) @ fc.T
    # HF's last hidden_states entry is after the final norm; earlier ones are layer outputs
    for layers, projection, expect in ((None, None, ref.last_hidden_state),
                                       ((0, 0), None, torch.cat([ref.hidden_states[1]] * 2, -1)),
                                       ((0, 1, 0), fc, fused)):
        graph = capture("target", hf, dim_ranges(4, 64))
        AddFeatureOutputs(layers, projection)(graph)
        assert graph.outputs == ["logits", "new_k", "new_v", "features"]
        dims = graph.dims
        empty = torch.zeros(dims.n_layers, 2, dims.n_kv_heads, 0, dims.head_dim)
        program = graph.export().module()
        logits, _, _, feats = _run(program, ids, torch.arange(7).expand(2, 7), torch.zeros(2, dtype=torch.long),
                                   torch.full((2, 1), 6), empty, empty)
        assert feats.shape == expect.shape
        assert (feats - expect).abs().max() < 1e-4
        assert (logits[:, 0] - hf.lm_head(ref.last_hidden_state[:, -1])).abs().max() < 1e-4
    with pytest.raises(PassContractError, match="requires no graph output 'features'"):
        AddFeatureOutputs()(graph)
    with pytest.raises(ValueError, match="feature layers must be in"):
        AddFeatureOutputs((5,))(capture("target", hf, dim_ranges(4, 64)))


def test_verify_head_keeps_the_feature_output(hf):
    from specc.passes.add_feature_outputs import AddFeatureOutputs
    from specc.passes.insert_verify_head import InsertVerifyHead

    graph = capture("target", hf, dim_ranges(4, 64))
    AddFeatureOutputs()(graph)
    InsertVerifyHead()(graph)
    assert graph.outputs == ["n_accepted", "next_token", "new_k", "new_v", "features"]


@pytest.mark.parametrize("arch", ["llama", "starcoder2", "gemma"])
def test_feature_output_is_the_models_own_final_norm(arch):
    """Medusa and EAGLE-1/2 heads read the final norm's output: RMSNorm, Gemma's (1 + w) RMSNorm, and
    StarCoder2's LayerNorm with a bias must all give what the model's own norm gives."""
    from specc.passes.add_feature_outputs import AddFeatureOutputs
    from specc.testing import tiny_model

    model = tiny_model(arch, seed=5)
    with torch.no_grad():  # a norm that is not the identity at init, so a wrong kind of norm shows
        model.model.norm.weight.uniform_(0.5, 1.5)
        if getattr(model.model.norm, "bias", None) is not None:
            model.model.norm.bias.uniform_(-0.5, 0.5)
    ids = torch.randint(0, 256, (1, 6))
    with torch.no_grad():
        expect = model.model(ids).last_hidden_state
    graph = capture("target", model, dim_ranges(4, 64))
    AddFeatureOutputs()(graph)
    dims = graph.dims
    empty = torch.zeros(dims.n_layers, 1, dims.n_kv_heads, 0, dims.head_dim)
    *_, feats = _run(graph.export().module(), ids, torch.arange(6)[None], torch.zeros(1, dtype=torch.long),
                     torch.full((1, 1), 5), empty, empty)
    assert (feats - expect).abs().max() < 1e-4
