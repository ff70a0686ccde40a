"""Does a quantised target's kernel give a row the same bits in 1-token and multi-token passes *here*?

Target-only decoding runs 1-token passes, a verify pass k+1 tokens; a kernel whose rows depend on the
pass size can flip a near-tied greedy choice, so speculative output would differ from the bundle's own
target-only output. Compile records the answer on the compiling machine (`rows_independent_of_pass_size`
in the graph's `weight_quant`), but kernels are chosen per CPU at run time: ONNX Runtime 1.32's int4
MatMulNBits is row-invariant at block 32, accuracy level 4 with AVX-512 VNNI and at no setting on an
AVX2-only CPU (stop 32). The runtime asks again where it runs.
"""
from __future__ import annotations

import functools

from .integer_gemm import rows_independent_of_pass_size as int8_gemm_rows_independent
from .matmul_nbits import rows_independent_of_pass_size as nbits_rows_independent

PROBE_K = 1536  # a multiple of every block size the recipes allow


@functools.lru_cache(maxsize=None)
def _nbits(bits: int, block_size: int, accuracy_level: int) -> bool:
    return nbits_rows_independent(PROBE_K, 256, bits, block_size, accuracy_level)


def rows_independent_here(weight_quant: dict | None) -> bool | None:
    """The probe of this machine for a graph's `weight_quant` facts; None where the graph has none."""
    if not weight_quant:
        return None
    if weight_quant.get("kind") == "int8-gemm":
        return _int8_gemm()
    return _nbits(int(weight_quant["bits"]), int(weight_quant["block_size"]), int(weight_quant["accuracy_level"]))


_int8_gemm = functools.lru_cache(maxsize=None)(int8_gemm_rows_independent)
