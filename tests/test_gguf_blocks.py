"""GGUF blocks imported without a second rounding: the MatMulNBits form dequantises bit for bit to gguf-py's values."""
from __future__ import annotations

import numpy as np
import pytest

from specc.models.gguf_blocks import blocks_to_weight, gguf_tensor_name, read_gguf_blocks

N, K, HEADS, KV_HEADS = 32, 512, 4, 2


def _random_k_blocks(kind: str, rows: int, k: int, rng) -> np.ndarray:
    """Valid Q4_K / Q6_K rows: random packed values and scales, finite fp16 super-block scales."""
    n = rows * k // 256
    if kind == "Q4_K":
        d = rng.uniform(1e-3, 2e-2, (n, 2)).astype(np.float16).view(np.uint8)
        rest = rng.integers(0, 256, (n, 140), dtype=np.uint8)
        return np.concatenate([d, rest], 1).reshape(rows, -1)
    body = rng.integers(0, 256, (n, 208), dtype=np.uint8)
    d = rng.uniform(1e-4, 1e-2, (n, 1)).astype(np.float16).view(np.uint8)
    return np.concatenate([body, d], 1).reshape(rows, -1)


def _raw(kind: str, w: np.ndarray, rng) -> np.ndarray:
    from gguf import GGMLQuantizationType, quants

    if kind in ("Q4_K", "Q6_K"):
        return _random_k_blocks(kind, *w.shape, rng)
    return quants.quantize(w, GGMLQuantizationType[kind])


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_imported_blocks_dequantise_exactly(kind):
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(0)
    raw = _raw(kind, rng.normal(size=(N, K)).astype(np.float32), rng)
    bw = blocks_to_weight(kind, raw, K)
    expected = quants.dequantize(raw, GGMLQuantizationType[kind])
    assert np.array_equal(bw.dequantize(), expected)
    assert bw.bits == (8 if kind in ("Q8_0", "Q6_K") else 4)
    assert (bw.offsets is not None) == (kind in ("Q4_1", "Q4_K"))
    assert bw.q.max() < 2 ** bw.bits


def test_other_types_are_refused():
    with pytest.raises(ValueError, match="no exact MatMulNBits form.*Q4_0"):
        blocks_to_weight("Q5_K", np.zeros((1, 176), np.uint8), 256)


def test_tensor_names():
    assert gguf_tensor_name("layers.3.mlp.down_proj", tied=False) == "blk.3.ffn_down.weight"
    assert gguf_tensor_name("layers.0.self_attn.q_proj", tied=False) == "blk.0.attn_q.weight"
    assert gguf_tensor_name("lm_head", tied=True) == "token_embd.weight"
    assert gguf_tensor_name("lm_head", tied=False) == "output.weight"
    assert gguf_tensor_name("layers.0.mlp.act", tied=False) is None


def test_read_gguf_file(tmp_path):
    """A llama-style GGUF: each importable linear layer comes back with its GGUF values; q/k also in the
    row order transformers gives them (undoing llama.cpp's rotary permutation); F16 and too-few-bit
    tensors are left to quantisation from full precision."""
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    rng = np.random.default_rng(1)
    kinds = {"attn_q": "Q4_1", "attn_k": "Q4_K", "attn_v": "Q4_0", "attn_output": "Q8_0", "ffn_down": "Q6_K",
             "ffn_up": "F16"}
    raws = {}
    writer = GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    writer.add_block_count(1)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    for name, kind in kinds.items():
        w = rng.normal(size=(N, K)).astype(np.float32)
        if kind == "F16":
            writer.add_tensor(f"blk.0.{name}.weight", w.astype(np.float16))
            continue
        raws[name] = _raw(kind, w, rng)
        writer.add_tensor(f"blk.0.{name}.weight", raws[name], raw_dtype=GGMLQuantizationType[kind])
    writer.add_tensor("token_embd.weight", quants.quantize(rng.normal(size=(N, K)).astype(np.float32),
                                                           GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    blocks = read_gguf_blocks(tmp_path / "m.gguf", min_bits=4)
    assert set(blocks) == {"lm_head", "layers.0.self_attn.q_proj", "layers.0.self_attn.k_proj", "layers.0.self_attn.v_proj",
                           "layers.0.self_attn.o_proj", "layers.0.mlp.down_proj"}
    for module, gguf_name in [("layers.0.self_attn.v_proj", "attn_v"), ("layers.0.mlp.down_proj", "ffn_down")]:
        expected = quants.dequantize(raws[gguf_name], GGMLQuantizationType[kinds[gguf_name]])
        assert len(blocks[module]) == 1 and np.array_equal(blocks[module][0].dequantize(), expected)
    for module, gguf_name, heads in [("layers.0.self_attn.q_proj", "attn_q", HEADS), ("layers.0.self_attn.k_proj", "attn_k", KV_HEADS)]:
        stored = quants.dequantize(raws[gguf_name], GGMLQuantizationType[kinds[gguf_name]])
        hf_order = stored.reshape(heads, N // heads // 2, 2, K).swapaxes(2, 1).reshape(N, K)  # transformers' reverse_permute
        assert [np.array_equal(c.dequantize(), x) for c, x in zip(blocks[module], (stored, hf_order))] == [True, True]
    assert set(read_gguf_blocks(tmp_path / "m.gguf", min_bits=8)) == {"lm_head", "layers.0.self_attn.o_proj",
                                                                        "layers.0.mlp.down_proj"}
    # target.gguf_requantize: [Q6_K, Q8_0] leaves those layers to quantisation from the dequantised weights
    assert set(read_gguf_blocks(tmp_path / "m.gguf", min_bits=4, skip=("Q6_K", "Q8_0"))) == {
        "layers.0.self_attn.q_proj", "layers.0.self_attn.k_proj", "layers.0.self_attn.v_proj"}


@pytest.mark.real_model
@pytest.mark.heavy  # about a minute: the int4 compile of a 135M model
def test_smollm2_gguf_blocks_are_kept(tmp_path):
    """The catalog's SmolLM2 GGUF (Q4_1 layers, Q8_0 embedding/LM head) compiles to int4 with every linear
    layer taken from the GGUF as stored."""
    import specc
    from specc.compiler import compile_recipe
    from specc.recipe import parse_recipe

    recipe = parse_recipe({"target": {"model": "smollm2-135m-instruct", "quantize": "int4"},
                           "draft": {"method": "prompt_lookup"}, "limits": {"max_batch": 1, "max_context": 256}})
    bundle = compile_recipe(recipe, output=tmp_path / "b", progress=False)
    layers = specc.load(bundle).bundle.graph("target").facts["weight_quant"]["layers"]
    assert layers == {"gguf:Q4_1 int4 block 32 +offsets": 210, "gguf:Q8_0 int8 block 32": 1}
