"""specc's int4 x int8 kernels (specc/kernels): every ISA's kernel gives the scalar reference's bits, a row's output
does not depend on the pass it is in, and the reference computes what its definition says (csrc/q4gemm.h)."""
from __future__ import annotations

import numpy as np
import pytest

from specc import kernels
from specc.block_weights import BlockWeight, quantize_rtn
from specc.errors import SpeccError
from specc.kernels.pack import dequantize, pack_int4, quantized_activations

pytestmark = pytest.mark.skipif(not kernels.available(), reason="specc's kernel library is not built here")

SHAPES = [(64, 96), (37, 80), (8, 32), (300, 1536), (1, 33)]  # odd N and K, a partial panel, K below one block


def _weights(n: int, k: int, form: str, seed: int = 0) -> BlockWeight:
    """A 4-bit block-32 weight in one of the forms the importers produce."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(n, k)).astype(np.float32)
    if form == "symmetric":  # Q4_0 and round to nearest: zero point 8, no offset
        return quantize_rtn(w, 4, 32, True)
    if form == "zero_points":  # asymmetric round to nearest
        return quantize_rtn(w, 4, 32, False)
    bw = quantize_rtn(w, 4, 32, True)  # Q4_1 / Q4_K: zero point 0 and a float offset per block
    bw.zero_points[:] = 0
    bw.offsets = rng.normal(size=bw.scales.shape).astype(np.float32) * 0.1
    return bw


def _activations(m: int, k: int, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(m, k)).astype(np.float32) * rng.choice([1.0, 40.0], size=k, p=[0.97, 0.03]).astype(np.float32)
    x[0, :min(k, 32)] = 0  # a block of zeros: scale 0
    return x


@pytest.mark.parametrize("form", ["symmetric", "zero_points", "offsets"])
@pytest.mark.parametrize("n,k", SHAPES)
def test_every_isa_gives_the_scalar_references_bits(n, k, form):
    w = pack_int4(_weights(n, k, form))
    assert w.offsets is (form != "symmetric")
    x = _activations(9, k)
    reference = kernels.gemm(x, w, "scalar")
    for isa in kernels.supported_isas():
        for threads in (1, 2):
            assert np.array_equal(kernels.gemm(x, w, isa, threads), reference), (isa, threads)


@pytest.mark.parametrize("n,k", [(520, 2400), (136, 8000)])
def test_panels_claimed_by_whichever_thread_is_free_have_the_references_bits(n, k):
    """Past each thread's even share, the last panels go to whichever thread is free, a claim at a time (one panel of
    a wide K, two, a partial last panel): every row still has the reference's bits."""
    w = pack_int4(_weights(n, k, "offsets"))
    for m in (1, 3, 9):
        x = _activations(m, k)
        reference = kernels.gemm(x, w, "scalar")
        for isa in kernels.supported_isas():
            for threads in (2, 3):
                assert np.array_equal(kernels.gemm(x, w, isa, threads), reference), (isa, m, threads)


def test_an_output_written_around_the_caches_has_the_references_bits():
    """A prefill chunk's output through a wide layer (2 MB and more) is written with non-temporal stores."""
    w = pack_int4(_weights(8192, 64, "offsets"))
    x = _activations(64, 64)
    y = kernels.gemm(x, w, "scalar")
    assert y.nbytes >= 2 << 20 and y.ctypes.data % 64 == 0
    for isa in kernels.supported_isas():
        assert np.array_equal(kernels.gemm(x, w, isa, 2), y), isa


@pytest.mark.parametrize("form", ["symmetric", "offsets"])
def test_the_reference_multiplies_int8_activations_by_the_packed_weight(form):
    bw = _weights(48, 200, form)
    x = _activations(5, 200)
    y = kernels.gemm(x, pack_int4(bw), "scalar")
    ref = quantized_activations(x) @ dequantize(bw).T
    assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()
    assert np.abs(y - x @ dequantize(bw).T).max() > 1e-4 * np.abs(ref).max()  # the activations really are int8


def test_a_row_has_the_same_bits_in_passes_of_every_size():
    """A verify pass of k+1 rows gives each row the bits a 1-row decode pass gives it, on every kernel."""
    w = pack_int4(_weights(136, 640, "offsets"))
    x = _activations(16, 640)
    for isa in kernels.supported_isas():
        alone = np.concatenate([kernels.gemm(x[i:i + 1], w, isa, 2) for i in range(16)])
        for m in range(1, 17):
            assert np.array_equal(kernels.gemm(x[:m], w, isa, 2), alone[:m]), (isa, m)


def test_a_broken_kernel_would_be_caught():
    """The bit comparison sees a change in the last place of one output."""
    w = pack_int4(_weights(64, 96, "symmetric"))
    x = _activations(4, 96)
    y = kernels.gemm(x, w)
    y[2, 5] = np.nextafter(y[2, 5], np.inf)
    assert not np.array_equal(y, kernels.gemm(x, w, "scalar"))


def test_packing_refuses_what_the_kernels_do_not_take():
    w = np.random.default_rng(0).normal(size=(16, 64)).astype(np.float32)
    with pytest.raises(ValueError, match="4-bit weights in blocks of 32, not 8-bit blocks of 32"):
        pack_int4(quantize_rtn(w, 8, 32))
    with pytest.raises(ValueError, match="not 4-bit blocks of 64"):
        pack_int4(quantize_rtn(w, 4, 64))
    huge = quantize_rtn(w, 4, 32)
    huge.scales[0, 0] = 1e6
    with pytest.raises(ValueError, match="beyond fp16's range"):
        pack_int4(huge)


def test_the_packed_bytes_are_what_the_layout_says():
    """4.5 bits a weight for symmetric blocks, 5 with offsets; N padded to panels of 16."""
    assert pack_int4(_weights(64, 96, "symmetric")).data.nbytes == 4 * 3 * (256 + 32) == 64 * 96 * 4.5 / 8
    assert pack_int4(_weights(60, 96, "offsets")).data.nbytes == 4 * 3 * (256 + 64)
    lib = kernels.library()
    assert lib.specc_int4_packed_bytes(60, 96, 1) == 4 * 3 * (256 + 64)


def test_kernel_choice_and_its_errors(monkeypatch):
    assert kernels.supported_isas()[0] == "scalar" and kernels.best_isa() in kernels.supported_isas()
    monkeypatch.setenv("SPECC_KERNEL_ISA", "scalar")
    assert kernels.active_isa() == "scalar"
    monkeypatch.setenv("SPECC_KERNEL_ISA", "sse9")
    with pytest.raises(SpeccError, match="SPECC_KERNEL_ISA='sse9' names no kernel; allowed: scalar, avx2"):
        kernels.active_isa()
    w = pack_int4(_weights(8, 32, "symmetric"))
    with pytest.raises(SpeccError, match=r"x must be \[m, 32\], got \[2, 31\]"):
        kernels.gemm(np.zeros((2, 31), np.float32), w)
    with pytest.raises(SpeccError, match="no kernel 'neon'"):
        kernels.gemm(np.zeros((2, 32), np.float32), w, "neon")
    missing = [isa for isa in kernels.ISAS if isa not in kernels.supported_isas()]
    if missing:
        with pytest.raises(SpeccError, match=f"kernel {missing[0]} does not run on this CPU"):
            kernels.gemm(np.zeros((2, 32), np.float32), w, missing[0])


def _int4_graph(w, rank: int = 3, n_attr: int | None = None, k_dim: int | str | None = None,
                layout: int = kernels.LAYOUT):
    from onnx import TensorProto, helper, numpy_helper

    node = helper.make_node(kernels.OP, ["x", "W"], ["y"], domain=kernels.DOMAIN, N=n_attr or w.n, K=w.k,
                            offsets=int(w.offsets), layout=layout)
    lead = ["b", "t"][:rank - 1]
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, lead + [k_dim or w.k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, lead + [w.n])],
                              [numpy_helper.from_array(w.data, "W")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(kernels.DOMAIN, 1)])


def _session(model):
    import onnxruntime as ort

    so = ort.SessionOptions()
    kernels.register_with(so)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def test_onnx_runtime_runs_the_kernel_chosen_here():
    w = pack_int4(_weights(37, 80, "offsets"))
    x = _activations(6, 80)
    y = _session(_int4_graph(w)).run(None, {"x": x.reshape(2, 3, 80)})[0]
    assert y.shape == (2, 3, 37)
    assert np.array_equal(y.reshape(6, 37), kernels.gemm(x, w, "scalar"))
    assert np.array_equal(_session(_int4_graph(w, rank=2)).run(None, {"x": x})[0], y.reshape(6, 37))
    assert _session(_int4_graph(w)).run(None, {"x": np.zeros((1, 0, 80), np.float32)})[0].shape == (1, 0, 37)


def test_onnx_runtime_reports_bad_operands():
    from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument

    w = pack_int4(_weights(37, 80, "offsets"))
    with pytest.raises(InvalidArgument, match="Int4Gemm: X's last dimension must be K = 80"):
        _session(_int4_graph(w, k_dim="k")).run(None, {"x": np.zeros((1, 2, 64), np.float32)})
    with pytest.raises(InvalidArgument, match="Int4Gemm: W must hold"):
        _session(_int4_graph(w, n_attr=55)).run(None, {"x": np.zeros((1, 2, 80), np.float32)})


def test_weights_packed_in_another_layout_are_refused():
    """A bundle compiled by a specc whose kernels packed weights otherwise must not run on these kernels."""
    w = pack_int4(_weights(37, 80, "offsets"))
    with pytest.raises(Exception, match="packed in layout 1 but this specc's kernels take layout 2; compile the bundle again"):
        _session(_int4_graph(w, layout=1))


def test_loading_a_bundle_graph_of_another_layout_says_to_compile_again(tmp_path):
    import onnx

    from specc.backends.onnxruntime_backend import OnnxRuntimeBackend
    from specc.errors import BundleError

    onnx.save(_int4_graph(pack_int4(_weights(37, 80, "offsets")), layout=1), str(tmp_path / "model.nbits.onnx"))
    entry = {"entry": "model.nbits.onnx", "files": ["model.nbits.onnx"], "weight_quant": {"kind": "int4-gemm"}}
    with pytest.raises(BundleError, match="packed in layout 1 .* compile the bundle again"):
        OnnxRuntimeBackend().load(tmp_path, entry, None)
