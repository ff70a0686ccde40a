"""target.quantize: block-wise int4/int8 MatMulNBits targets, the int8-gemm integer-GEMM target and the int4-gemm
target on specc's own kernels; speculation stays lossless relative to them."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import specc
from specc.compiler import compile_recipe
from lossless_checks import token_prompts
from specc.block_weights import quantize_rtn
from specc.onnx_passes.quantize_int8_gemm import quantize_channels
from specc.errors import RecipeError
from specc.recipe import parse_recipe
from specc.speculation import sampling
from specc.testing import derive_draft, make_tiny_model
from stats_helpers import FAIL_P, PASS_P, chi2_pvalue, total_variation
from test_lossless_sampling import PARAMS, VOCAB, _accept_everything, draw, exact_marginals


def test_recipe_fields_and_errors():
    ok = parse_recipe({"target": {"model": "m", "quantize": "int4", "block_size": 64, "keep_float": ["lm_head"]},
                       "draft": {"method": "none"}})
    assert ok.target.block_size == 64
    with pytest.raises(RecipeError, match="target.quantize.*torch"):
        parse_recipe({"target": {"model": "m", "quantize": "int4"}, "draft": {"method": "none"}, "backend": "torch"})
    with pytest.raises(RecipeError, match="target.block_size.*only applies"):
        parse_recipe({"target": {"model": "m", "block_size": 64}, "draft": {"method": "none"}})
    with pytest.raises(RecipeError, match="target.block_size.*not allowed"):
        parse_recipe({"target": {"model": "m", "quantize": "int4", "block_size": 48}, "draft": {"method": "none"}})
    with pytest.raises(RecipeError, match="target.quantize.*fp8 weights are for backend tensorrt"):
        parse_recipe({"target": {"model": "m", "quantize": "fp8"}, "draft": {"method": "none"}})
    trt = parse_recipe({"target": {"model": "m", "quantize": "fp8"}, "draft": {"method": "none"}, "backend": "tensorrt",
                        "device": "cuda"})
    assert trt.target.quantize == "fp8"
    assert parse_recipe({"target": {"model": "m", "quantize": "int8-gemm", "keep_float": ["lm_head"]},
                         "draft": {"method": "none"}}).target.quantize == "int8-gemm"
    with pytest.raises(RecipeError, match="target.block_size.*does not apply to int8-gemm"):
        parse_recipe({"target": {"model": "m", "quantize": "int8-gemm", "block_size": 64}, "draft": {"method": "none"}})
    with pytest.raises(RecipeError, match="target.quantize.*int8-gemm.*backend onnxruntime only"):
        parse_recipe({"target": {"model": "m", "quantize": "int8-gemm"}, "draft": {"method": "none"}, "backend": "tensorrt",
                      "device": "cuda"})
    assert parse_recipe({"target": {"model": "m", "quantize": "int4-gemm", "gguf_requantize": ["Q6_K"]},
                         "draft": {"method": "none"}}).target.quantize == "int4-gemm"
    with pytest.raises(RecipeError, match="target.block_size.*does not apply to int4-gemm"):
        parse_recipe({"target": {"model": "m", "quantize": "int4-gemm", "block_size": 64}, "draft": {"method": "none"}})
    with pytest.raises(RecipeError, match="target.quantize.*int4-gemm.*backend onnxruntime only"):
        parse_recipe({"target": {"model": "m", "quantize": "int4-gemm"}, "draft": {"method": "none"}, "backend": "tensorrt",
                      "device": "cuda"})
    with pytest.raises(RecipeError, match="target.quantize.*allowed: int8, int4, int8-gemm, int4-gemm, fp8"):
        parse_recipe({"target": {"model": "m", "quantize": "int3"}, "draft": {"method": "none"}})
    q6 = parse_recipe({"target": {"model": "m", "quantize": "int4", "gguf_requantize": ["Q6_K"]}, "draft": {"method": "none"}})
    assert q6.target.gguf_requantize == ["Q6_K"]
    with pytest.raises(RecipeError, match="target.gguf_requantize.*'Q5_K' is not a GGUF block type.*allowed: Q4_0"):
        parse_recipe({"target": {"model": "m", "quantize": "int4", "gguf_requantize": ["Q5_K"]}, "draft": {"method": "none"}})
    with pytest.raises(RecipeError, match="target.gguf_requantize.*only applies with target.gguf_blocks true"):
        parse_recipe({"target": {"model": "m", "quantize": "int4", "gguf_blocks": False, "gguf_requantize": ["Q6_K"]},
                      "draft": {"method": "none"}})
    with pytest.raises(RecipeError, match="target.gguf_requantize.*only applies with target.quantize"):
        parse_recipe({"target": {"model": "m", "gguf_requantize": ["Q6_K"]}, "draft": {"method": "none"}})


def build_quantized(out, target, draft: dict, quant: dict, **extra):
    recipe = parse_recipe({"target": {"model": str(target), **quant}, "draft": draft,
                           "speculation": extra.pop("speculation", {"k": 3}),
                           "limits": extra.pop("limits", {"max_batch": 4, "max_context": 256}), **extra})
    return compile_recipe(recipe, output=out, progress=False)


@pytest.fixture(scope="module")
def quantized_bundles(models_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("qtarget")
    t = models_dir / "target"
    draft = {"method": "model", "model": str(models_dir / "draft")}
    wrong = {"method": "model", "model": str(models_dir / "wrong")}
    return {
        "int4": build_quantized(root / "int4", t, draft, {"quantize": "int4"}),
        "int8": build_quantized(root / "int8", t, draft, {"quantize": "int8", "block_size": 16}),
        "int4_wrong": build_quantized(root / "int4_wrong", t, wrong, {"quantize": "int4", "keep_float": ["lm_head"]}),
        "int8_gemm": build_quantized(root / "int8_gemm", t, draft, {"quantize": "int8-gemm"}),
        "int8_gemm_wrong": build_quantized(root / "int8_gemm_wrong", t, wrong, {"quantize": "int8-gemm"}),
        "int8_gemm_tree": build_quantized(root / "int8_gemm_tree", t, draft, {"quantize": "int8-gemm"},
                                          speculation={"mode": "tree", "tree": {"depth": 3, "branching": 2, "max_nodes": 6}}),
        "int4_gemm": build_quantized(root / "int4_gemm", t, draft, {"quantize": "int4-gemm"}),
        "int4_gemm_wrong": build_quantized(root / "int4_gemm_wrong", t, wrong, {"quantize": "int4-gemm"}),
        "int4_gemm_tree": build_quantized(root / "int4_gemm_tree", t, draft, {"quantize": "int4-gemm"},
                                          speculation={"mode": "tree", "tree": {"depth": 3, "branching": 2, "max_nodes": 6}}),
        "int4_lookup": build_quantized(root / "int4_lookup", t, {**draft, "lookup": True, "min_ngram": 2},
                                       {"quantize": "int4", "keep_float": ["layers.0.*"]}),
    }


def test_row_invariance_is_checked_and_recorded(quantized_bundles, caplog):
    """From how many rows on MatMulNBits computes a row the same in passes of any size depends on the CPU (ONNX
    Runtime 1.32: every size at block 32, accuracy level 4 with AVX-512 VNNI; on an AVX2-only CPU 2 rows, 1-row
    passes take a kernel of their own). Compile records the check where it compiles; the runtime asks again where
    it runs, pads its 1-token target passes to that many rows, and warns where no pass size is enough."""
    from specc.hardware import min_pass_rows_here
    from specc.onnx_passes.quantize_matmul_nbits import fewest_pass_rows

    here = fewest_pass_rows(64, 48, 4, 32, 4)
    assert here in (1, 2, None)
    q = specc.load(quantized_bundles["int4"]).bundle.graph("target").facts["weight_quant"]
    assert q["min_pass_rows"] == here and q["rows_independent_of_pass_size"] is (here == 1)  # compiled on this machine
    with caplog.at_level("WARNING", logger="specc"):
        model = specc.load(quantized_bundles["int4"])
    assert model.min_pass_rows == min_pass_rows_here(q) == fewest_pass_rows(1536, 256, 4, 32, 4)
    assert model.target.step.min_rows == (model.min_pass_rows or 1)
    assert ("computes a row differently in passes of different sizes" in caplog.text) is (model.min_pass_rows is None)
    gemm = specc.load(quantized_bundles["int8_gemm"])
    assert gemm.min_pass_rows == 1  # by construction, on every CPU
    assert specc.load(quantized_bundles["int4_gemm"]).min_pass_rows == 1  # likewise


def test_padded_one_row_passes_give_the_rows_of_larger_passes(quantized_bundles):
    """A 1-token pass padded to 2 rows returns what the unpadded graph returns for that token (logits and the KV and
    features of T tokens: the copy's are dropped) up to kernel rounding, and each padded decode step's logits are
    the bits the same token gets inside a 4-token pass, on every CPU (min_rows forced to 2 here)."""
    import torch

    from specc.runtime.kv_cache import KVCache

    model = specc.load(quantized_bundles["int4"])
    step, dims = model.target.step, model.target.dims
    ids = torch.tensor([model.tokenizer.encode("def add(a, b):\n    return a + b\n")], dtype=torch.long)[:, :12]
    cache = KVCache(dims, 1, 64)
    cache.ensure(ids.shape[1] + 4)
    out = dict(zip(step.output_names, step(ids[:, :8], cache, logit_index=torch.arange(8)[None])))
    cache.commit(out["new_k"], out["new_v"], torch.tensor([8]))
    step.min_rows = 1
    plain = dict(zip(step.output_names, step(ids[:, 8:9], cache, logit_index=torch.tensor([[0]]))))
    step.min_rows = 2
    padded = dict(zip(step.output_names, step(ids[:, 8:9], cache, logit_index=torch.tensor([[0]]))))
    assert {n: tuple(v.shape) for n, v in padded.items()} == {n: tuple(v.shape) for n, v in plain.items()}
    assert padded["new_k"].shape[3] == 1
    for name in plain:
        torch.testing.assert_close(padded[name], plain[name], rtol=2e-2, atol=2e-2)
    four = dict(zip(step.output_names, step(ids[:, 8:12], cache, logit_index=torch.arange(4)[None])))
    assert torch.equal(padded["logits"][:, 0], four["logits"][:, 0])
    assert torch.equal(padded["new_k"][..., 0, :], four["new_k"][..., 0, :])


def test_bundle_records_the_int8_gemm_target(quantized_bundles):
    from specc.cli.format import format_manifest

    model = specc.load(quantized_bundles["int8_gemm"])
    q = model.bundle.graph("target").facts["weight_quant"]
    assert q["kind"] == "int8-gemm" and q["rows_independent_of_pass_size"]
    assert q["layers"] == {"int8 per channel": 13} and q["merged_layers"] == 9  # 3 x (q+k+v, o, gate+up, down) + lm_head
    # a chain graph attends with keys at their positions in float32; a tree graph's siblings share a depth, so it
    # keeps the float64 fallback (onnx_passes/attend_at_cache_positions.py)
    assert (q["attention_at_positions"], q["attention_float64"]) == (3, 0)
    tree = specc.load(quantized_bundles["int8_gemm_tree"]).bundle.graph("target").facts["weight_quant"]
    assert (tree["attention_at_positions"], tree["attention_float64"]) == (0, 3)
    assert model.bundle.graph("target").quantize == "int8-gemm"
    text = format_manifest(model.bundle.manifest, model.bundle.path, True)
    assert "int8 per output channel, MatMulInteger" in text and "9 layers merged into one GEMM with another" in text
    assert "attention keys at their positions in float32 (3 nodes)" in text


def test_bundle_records_the_int4_gemm_target(quantized_bundles):
    from specc.cli.format import format_manifest
    from specc.kernels import active_isa

    model = specc.load(quantized_bundles["int4_gemm"])
    q = model.bundle.graph("target").facts["weight_quant"]
    assert q["kind"] == "int4-gemm" and q["rows_independent_of_pass_size"] and q["min_pass_rows"] == 1
    assert q["layers"] == {"rtn int4 block 32": 13} and q["merged_layers"] == 9
    assert q["kernel"] == f"ai.specc::Int4Gemm ({active_isa()})"
    text = format_manifest(model.bundle.manifest, model.bundle.path, True)
    assert "int4 blocks of 32, ai.specc::Int4Gemm" in text and "9 layers merged into one GEMM with another" in text
    # each layer's SwiGLU runs in its gate-and-up Int4Gemm (the greedy and sampled checks below run on it)
    assert q["gated_in_kernel"] == 3 and "SwiGLU in the kernel (3 layers)" in text
    # chain and tree graphs alike attend in the CacheAttention kernel: a tree node's slots hold its ancestors
    assert q["attention_in_kernel"] == 3 and not q.get("attention_float64")
    tree = specc.load(quantized_bundles["int4_gemm_tree"]).bundle.graph("target").facts["weight_quant"]
    assert tree["attention_in_kernel"] == 3 and not tree.get("attention_float64")


def test_bundle_records_the_quantisation(quantized_bundles):
    from specc.cli.format import format_manifest

    model = specc.load(quantized_bundles["int4_wrong"])
    q = model.bundle.graph("target").facts["weight_quant"]
    assert q["bits"] == 4 and q["block_size"] == 32 and q["layers"] == {"rtn int4 block 32": 21, "float32": 1}
    assert model.bundle.graph("target").entry == "model.nbits.onnx"
    text = format_manifest(model.bundle.manifest, model.bundle.path, True)
    assert "int4 MatMulNBits, block 32, accuracy level 4" in text and "float32 kept: lm_head" in text


@pytest.mark.parametrize("name,batch,k", [("int4", 1, 3), ("int4", 3, 5), ("int8", 2, 4), ("int4_wrong", 1, 3),
                                          ("int4_lookup", 3, 4), ("int8_gemm", 1, 3), ("int8_gemm", 3, 5),
                                          ("int8_gemm_wrong", 2, 4), ("int8_gemm_tree", 2, None), ("int4_gemm", 1, 3),
                                          ("int4_gemm", 3, 5), ("int4_gemm_wrong", 2, 4), ("int4_gemm_tree", 2, None)])
def test_greedy_speculation_equals_the_quantised_target(quantized_bundles, prompts, name, batch, k):
    """Greedy speculative output equals the same bundle's (quantised) target-only output on 60 prompts."""
    from specc.runtime.stats import RunStats

    assert len(prompts) >= 50
    model = specc.load(quantized_bundles[name])
    if model.min_pass_rows is None:
        pytest.skip(f"{name}: this CPU's kernels compute a row differently in passes of every size, so near-ties may "
                    "differ from target-only (the runtime warns: test_row_invariance_is_checked_and_recorded)")
    reference = [c.token_ids for p in prompts for c in model.generate([p], max_new_tokens=16, speculative=False)]
    bad, stats = [], RunStats()
    for lo in range(0, len(prompts), batch):
        fast = model.generate(prompts[lo:lo + batch], max_new_tokens=16, k=k)
        stats.merge(model.last_stats)
        bad += [lo + i for i, c in enumerate(fast) if c.token_ids != reference[lo + i]]
    assert bad == []
    rate = stats.to_dict()["acceptance_rate"]
    assert rate < 0.1 if name.endswith("_wrong") else 0 < rate < 1


def _dequantised_int4(w: np.ndarray) -> np.ndarray:
    return quantize_rtn(w, 4, 16).dequantize()


def _dequantised_int4_gemm(w: np.ndarray) -> np.ndarray:
    from specc.kernels.pack import dequantize

    return dequantize(quantize_rtn(w, 4, 32))


def _int8_superblocks(x: torch.Tensor) -> torch.Tensor:
    """x as Int4Gemm sees it (kernels/pack.py: quantized_activations)."""
    from specc.kernels.pack import quantized_activations

    return torch.from_numpy(quantized_activations(x.detach().numpy()))


def _dequantised_int8_gemm(w: np.ndarray) -> np.ndarray:
    q, scale = quantize_channels(w)
    return q.astype(np.float32) * scale[:, None]


# target.quantize settings of the small-vocabulary targets, the float weights they multiply by, what becomes of a
# linear layer's input (None: nothing), and how close the compiled target's logits come to the float32 model holding
# those weights and rounding those inputs, at every position and at the median position. int4 at accuracy level 1
# computes in float32; int8-gemm's two int8 activation parts differ from float32 by ~1e-4 relative (below what the
# sampling test can see). int4-gemm's int8 activations per block differ by a few per cent, so its reference rounds
# them as the kernel does and most positions agree to float rounding; where the graph's and the reference's float
# activations differ in their last bit across a rounding boundary, one int8 step differs and the later positions
# with it, so the bound at every position is looser, and the sampled checks take the compiled target's own
# distribution (its target-only logits, the same bits in any pass) as the one speculation must keep
SMALL_VOCAB_QUANT = {
    "int4": ({"quantize": "int4", "block_size": 16, "accuracy_level": 1}, _dequantised_int4, None, 1e-5, 1e-5),
    "int8-gemm": ({"quantize": "int8-gemm"}, _dequantised_int8_gemm, None, 2e-3, 2e-3),
    "int4-gemm": ({"quantize": "int4-gemm"}, _dequantised_int4_gemm, _int8_superblocks, 3e-2, 1e-5),
}


class _CompiledTarget(torch.nn.Module):
    """A bundle's compiled target called like a Hugging Face model (its target-only logits), for exact_marginals."""

    def __init__(self, bundle):
        super().__init__()
        self.model = specc.load(bundle)

    def forward(self, ids: torch.Tensor):
        from types import SimpleNamespace

        from specc.bench.quality import bundle_logits

        return SimpleNamespace(logits=torch.stack([torch.from_numpy(bundle_logits(self.model, row.tolist())) for row in ids]))


def _reference(dequantised, activations):
    """The float32 HF model holding the compiled target's weights, rounding its linear layers' inputs as the
    compiled target's kernels do."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(dequantised).eval()
    if activations is not None:
        for module in hf.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_pre_hook(lambda _m, args: (activations(args[0]),))
    return hf


@pytest.fixture(scope="module", params=list(SMALL_VOCAB_QUANT))
def small_vocab_quantised(request, tmp_path_factory):
    """A 24-token target compiled with each quantisation, the HF model holding exactly the weights the compiled
    target multiplies by (whose marginals are the quantised target's), and a perturbed 1-layer draft."""
    from transformers import AutoModelForCausalLM

    quant, dequantise, activations, tolerance, median = SMALL_VOCAB_QUANT[request.param]
    root = tmp_path_factory.mktemp("smallvocab_" + request.param)
    target = make_tiny_model(root / "target", seed=0, vocab_size=VOCAB, logit_scale=2.0)
    draft = derive_draft(target, root / "draft", layers=1, perturb=0.05)
    hf = AutoModelForCausalLM.from_pretrained(target).eval()
    with torch.no_grad():
        for name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(torch.from_numpy(dequantise(module.weight.numpy())))
    hf.save_pretrained(root / "dequantised")
    bundle = build_quantized(root / "bundle", target, {"method": "model", "model": str(draft)}, quant,
                             limits={"max_batch": 512, "max_context": 64}, speculation={"k": 2})
    reference = _reference(root / "dequantised", activations)
    distribution = reference if activations is None else _CompiledTarget(bundle)
    return reference, distribution, bundle, (tolerance, median)


def test_quantised_target_is_the_dequantised_model(small_vocab_quantised):
    """The compiled target computes the float32 model holding its quantised weights (to its tolerances)."""
    from specc.bench.quality import bundle_logits, hf_logits

    hf, _, bundle, (tolerance, median) = small_vocab_quantised
    model = specc.load(bundle)
    errors = []
    for ids in token_prompts(4):
        ref = hf_logits(hf, ids)
        error = np.abs(bundle_logits(model, ids) - ref).max(-1) / max(1.0, np.abs(ref).max())
        assert error.max() <= tolerance
        errors += list(error)
    assert np.median(errors) <= median


def test_sampled_output_has_the_quantised_targets_distribution(small_vocab_quantised):
    _, distribution, bundle, _ = small_vocab_quantised
    params = PARAMS[1]
    exact = exact_marginals(distribution, params)
    samples, stats = draw(bundle, params)
    assert 0.05 < stats["acceptance_rate"] < 0.95
    for pos in range(3):
        assert chi2_pvalue(samples[:, pos], exact[pos]) > PASS_P, (
            f"position {pos}, TV {total_variation(samples[:, pos], exact[pos]):.3f}")


def test_broken_rule_on_the_quantised_target_is_caught(small_vocab_quantised, monkeypatch):
    monkeypatch.setattr(sampling, "accept_sampled", _accept_everything)
    _, distribution, bundle, _ = small_vocab_quantised
    exact = exact_marginals(distribution, PARAMS[0])
    samples, _ = draw(bundle, PARAMS[0])
    assert chi2_pvalue(samples[:, 0], exact[0]) > PASS_P
    assert min(chi2_pvalue(samples[:, pos], exact[pos]) for pos in (1, 2)) < FAIL_P


def test_eval_cli_reports_the_quantised_target(quantized_bundles, capsys, tmp_path):
    """`specc eval` on an int4 bundle: agreement with float32 and perplexity, labelled with the quantisation."""
    from specc.cli import main

    out = tmp_path / "eval.json"
    assert main(["eval", str(quantized_bundles["int4"]), "--prompt", "the quick brown fox jumps over the lazy dog " * 3,
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "target int4 block 32" in printed and out.is_file()
