"""The SwiGLU kernel (csrc/glu.h) and Int4Gemm's gated product: every ISA gives the scalar reference's bits, the
reference is silu(gate) * up, a gated product is the SwiGLU of the plain product's halves in a pass of any size, and
gate_in_int4_gemm moves a graph's SwiGLU into the kernel."""
from __future__ import annotations

import numpy as np
import pytest

from specc import kernels
from specc.block_weights import quantize_rtn
from specc.errors import SpeccError
from specc.kernels.pack import pack_int4

pytestmark = pytest.mark.skipif(not kernels.available(), reason="specc's kernel library is not built here")


def _gate_and_up(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    gate = rng.normal(size=n).astype(np.float32) * rng.choice([1.0, 30.0], size=n).astype(np.float32)
    up = rng.normal(size=n).astype(np.float32)
    special = np.array([0.0, -0.0, 1e-30, -1e-30, 79.9, -79.9, 80.0, -80.0, 100.0, -100.0, 1e30, -1e30, 88.8, -88.8],
                       np.float32)
    gate[:len(special)] = special
    return gate, up


def test_every_isa_gives_the_scalar_references_bits():
    gate, up = _gate_and_up(1000 + 7)  # not a multiple of 16: the tail too
    reference = kernels.swiglu(gate, up, "scalar")
    assert np.isfinite(reference).all()
    for isa in kernels.supported_isas():
        assert np.array_equal(kernels.swiglu(gate, up, isa), reference), isa


def test_the_reference_is_silu_of_the_gate_times_up():
    gate, up = _gate_and_up(4096, seed=1)
    g, u = gate.astype(np.float64), up.astype(np.float64)
    exact = g / (1 + np.exp(np.minimum(-g, 700))) * u
    y = kernels.swiglu(gate, up, "scalar")
    assert np.abs(y - exact).max() <= 4e-7 * np.abs(exact).max()
    broken = y.copy()
    broken[3] = np.nextafter(broken[3], np.inf)
    assert not np.array_equal(broken, kernels.swiglu(gate, up))


def _gated_weight(half: int, k: int, seed: int = 2):
    rng = np.random.default_rng(seed)
    return pack_int4(quantize_rtn(rng.normal(size=(2 * half, k)).astype(np.float32), 4, 32, True))


@pytest.mark.parametrize(("m", "half", "k"), [(1, 48, 96), (5, 48, 96), (16, 160, 64), (40, 8192, 64)])
def test_a_gated_product_is_swiglu_of_the_products_halves(m, half, k):
    """Small passes (through a product kept whole) and a pass whose product is over 2 MB (gated tile by tile)."""
    w = _gated_weight(half, k)
    x = np.random.default_rng(3).normal(size=(m, k)).astype(np.float32)
    z = kernels.gemm(x, w, "scalar")
    reference = kernels.swiglu(z[:, :half], z[:, half:], "scalar")
    assert (m * 2 * half * 4 >= 2 << 20) == (m == 40)
    for isa in kernels.supported_isas():
        for threads in (1, 2):
            assert np.array_equal(kernels.gemm(x, w, isa, threads, glu=True), reference), (isa, threads)


def test_a_gated_row_has_the_same_bits_in_passes_of_every_size():
    w = _gated_weight(8192, 64)
    x = np.random.default_rng(4).normal(size=(40, 64)).astype(np.float32)
    for isa in kernels.supported_isas():
        whole = kernels.gemm(x, w, isa, 2, glu=True)
        for m in (1, 2, 5, 9, 16):
            assert np.array_equal(kernels.gemm(x[:m], w, isa, 2, glu=True), whole[:m]), (isa, m)
        assert np.array_equal(kernels.gemm(x[-1:], w, isa, 2, glu=True), whole[-1:]), isa


def test_a_weight_that_is_not_two_even_halves_is_refused():
    w = pack_int4(quantize_rtn(np.ones((48, 32), np.float32), 4, 32, True))
    with pytest.raises(SpeccError, match="two halves"):
        kernels.gemm(np.ones((1, 32), np.float32), w, glu=True)
