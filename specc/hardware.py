"""What this machine's CPU offers the kernels specc chooses between.

The same bundle or training run can differ several-fold between CPUs: bfloat16 matmuls are native
only with AVX512-BF16 or AMX (emulated, slower than float32, elsewhere), and the integer GEMM of an
`int8-gemm` target has VNNI/AMX kernels or falls back to AVX2. `specc doctor` shows this, train-head
warns before an emulated bfloat16 run, and bench results record it beside their numbers.

Kernels are also chosen per CPU at run time: a quantised target's kernel may give a row other bits in
a 1-token pass than in a k+1-token verify, which can flip a near-tied greedy choice. Compile records
what the compiling machine's kernels do; `min_pass_rows_here` asks the kernels of this one, and the
runtime pads its 1-token target passes to that many rows (runtime/step.py).
"""
from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

from .onnx_passes.quantize_int4_gemm import rows_independent_of_pass_size as int4_rows_independent_of_pass_size
from .onnx_passes.quantize_int8_gemm import rows_independent_of_pass_size
from .onnx_passes.quantize_matmul_nbits import fewest_pass_rows

# flags that decide which kernels run (x86 names from /proc/cpuinfo; Arm's from its Features line)
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8",
                "asimddp", "i8mm", "bf16", "sve")
BFLOAT16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8", "asimddp", "i8mm")


def _cpuinfo(path: Path = Path("/proc/cpuinfo")) -> tuple[str, set[str]]:
    """(model name, flags) of the first processor listed; ('', set()) where there is no such file."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "", set()
    model, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "cpu model") and not model:
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = set(value.split())
    return model, flags


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpu(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict:
    """The CPU as bench results record it: model, usable cores, the kernel-relevant flags present."""
    model, flags = _cpuinfo(cpuinfo)
    return {"model": model or platform.processor() or platform.machine(), "cores": usable_cores(),
            "flags": [f for f in KERNEL_FLAGS if f in flags],
            "native_bfloat16": any(f in flags for f in BFLOAT16_FLAGS),
            "int8_dot_product": any(f in flags for f in INT8_DOT_FLAGS)}


def describe(info: dict) -> list[str]:
    """doctor's lines for cpu()'s result."""
    flags = ", ".join(info["flags"]) or "none of " + ", ".join(KERNEL_FLAGS)
    return [f"cpu: {info['model']}, {info['cores']} usable cores; kernel flags: {flags}",
            "  bfloat16 matmuls: " + ("native" if info["native_bfloat16"] else
                                      "emulated (no AVX512-BF16/AMX): train-head --dtype bfloat16 is slower "
                                      "than float32 here"),
            "  int8 dot products: " + ("native (VNNI/AMX or Arm dot product)" if info["int8_dot_product"] else
                                       "none (no VNNI/AMX): each verify row of an int4 or int8-gemm target is expensive "
                                       "(a sizeable part of a decode pass, docs/quantization.md), so short chains pay best: "
                                       "let specc tune pick k, and try draft.stop_below")]


PROBE_K = 1536  # a multiple of every block size the recipes allow


@functools.lru_cache(maxsize=None)
def _nbits_rows(bits: int, block_size: int, accuracy_level: int) -> int | None:
    return fewest_pass_rows(PROBE_K, 256, bits, block_size, accuracy_level)


@functools.lru_cache(maxsize=None)
def _int8_gemm_rows() -> int | None:
    return 1 if rows_independent_of_pass_size() else None


@functools.lru_cache(maxsize=None)
def _int4_gemm_rows() -> int | None:
    return 1 if int4_rows_independent_of_pass_size() else None


def min_pass_rows_here(weight_quant: dict | None) -> int | None:
    """The fewest rows a pass of a graph quantised as `weight_quant` (its manifest entry) needs on this CPU for
    each row to get the bits it gets in any larger pass: 1 (no quantised kernels, or row-invariant ones), 2, or
    None (no pass size is enough)."""
    if not weight_quant:
        return 1
    if weight_quant.get("kind") == "int8-gemm":
        return _int8_gemm_rows()
    if weight_quant.get("kind") == "int4-gemm":
        return _int4_gemm_rows()
    return _nbits_rows(int(weight_quant["bits"]), int(weight_quant["block_size"]), int(weight_quant["accuracy_level"]))
