"""From how many rows on does a quantised target's kernel give a row the same bits in passes of any size *here*?

Target-only decoding runs 1-token passes, a verify pass k+1 tokens; a kernel whose rows depend on the
pass size can flip a near-tied greedy choice, so speculative output would differ from the bundle's own
target-only output. Compile records the answer on the compiling machine (`min_pass_rows` in the graph's
`weight_quant`), but kernels are chosen per CPU at run time: ONNX Runtime 1.32's int4 MatMulNBits agrees
in every pass size at block 32, accuracy level 4 with AVX-512 VNNI, and on an AVX2-only CPU in every pass
of 2 rows or more (1-row passes take a GEMV kernel of their own; stop 33). The runtime asks again where
it runs and pads its 1-token target passes to that many rows (runtime/step.py).
"""
from __future__ import annotations

import functools

from .integer_gemm import rows_independent_of_pass_size as int8_gemm_rows_independent
from .matmul_nbits import fewest_pass_rows

PROBE_K = 1536  # a multiple of every block size the recipes allow


@functools.lru_cache(maxsize=None)
def _nbits(bits: int, block_size: int, accuracy_level: int) -> int | None:
    return fewest_pass_rows(PROBE_K, 256, bits, block_size, accuracy_level)


@functools.lru_cache(maxsize=None)
def _int8_gemm() -> int | None:
    return 1 if int8_gemm_rows_independent() else None


def min_pass_rows_here(weight_quant: dict | None) -> int | None:
    """The fewest rows a pass of the graph needs on this CPU for each row to get the bits it gets in any larger pass:
    1 (no quantised kernels, or row-invariant ones), 2, or None (no pass size is enough)."""
    if not weight_quant:
        return 1
    if weight_quant.get("kind") == "int8-gemm":
        return _int8_gemm()
    return _nbits(int(weight_quant["bits"]), int(weight_quant["block_size"]), int(weight_quant["accuracy_level"]))
