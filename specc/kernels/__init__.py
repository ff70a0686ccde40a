"""specc's own CPU kernels, one per x86 ISA, chosen at run time: int4 weights times int8 activations (Int4Gemm), and
a chain or tree pass's attention over the cache with its new keys at their positions (CacheAttention).

The library (csrc/, built when the package installs) serves two callers: ONNX Runtime, as the custom operators
`ai.specc::Int4Gemm` and `ai.specc::CacheAttention` of `target.quantize: int4-gemm` graphs (register_with), and Python
through ctypes (gemm, cache_attention), for the tests that hold every ISA's kernel to the scalar reference and for
scripts/bench_kernels.py. Every kernel gives a row the same bits whatever else its pass holds, and the same bits as
the scalar reference (csrc/q4gemm.h, csrc/attention.h).

SPECC_KERNEL_ISA (scalar, avx2, avxvnni, avx512vnni) picks the kernels ONNX Runtime runs where this CPU has them;
SPECC_KERNEL_THREADS the threads they use (default: the CPUs this process may run on).
"""
from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import numpy as np

from ..errors import SpeccError
from .pack import LAYOUT, PackedInt4, pack_int4

ISAS = ("scalar", "avx2", "avxvnni", "avx512vnni")  # the order of the library's Isa enum
ABI = 2  # the library's specc_kernels_abi(): the C functions' signatures this module calls
DOMAIN = "ai.specc"
OP = "Int4Gemm"
ATTENTION_OP = "CacheAttention"


class KernelsUnavailable(SpeccError):
    """The kernel library was not built or cannot be opened here."""


def library_path() -> Path | None:
    """The built library next to this file, or None."""
    found = sorted(Path(__file__).parent.glob("_specc_kernels*.so"))
    return found[0] if found else None


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL:
    """The opened kernel library; KernelsUnavailable with what to do where it is missing."""
    path = library_path()
    if path is None:
        raise KernelsUnavailable(
            "specc's kernel library is not built (it needs a C++ compiler when specc installs): install g++ "
            "(apt-get install g++) and reinstall specc (pip install -e .), or choose target.quantize int4 or int8-gemm")
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise KernelsUnavailable(f"specc's kernel library {path} cannot be opened: {e}") from None
    lib.specc_isa_name.restype = ctypes.c_char_p
    lib.specc_int4_packed_bytes.restype = ctypes.c_longlong
    lib.specc_int4_packed_bytes.argtypes = [ctypes.c_longlong, ctypes.c_longlong, ctypes.c_int]
    lib.specc_int4_gemm.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_void_p, ctypes.c_longlong,
                                    ctypes.c_longlong, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    p = ctypes.c_void_p
    lib.specc_swiglu.argtypes = [ctypes.c_int, p, p, p, ctypes.c_longlong]
    lib.specc_cache_attention.argtypes = [ctypes.c_int, p, p, p, p, p, p, p, p] + [ctypes.c_longlong] * 8 + [
        ctypes.c_float, p, ctypes.c_int]
    names = [lib.specc_isa_name(i).decode() for i in range(lib.specc_isa_count())]
    if lib.specc_kernels_abi() != ABI or names != list(ISAS):
        raise KernelsUnavailable(f"specc's kernel library {path} is from another specc version: reinstall specc")
    return lib


def available() -> bool:
    try:
        library()
    except KernelsUnavailable:
        return False
    return True


def supported_isas() -> list[str]:
    """The kernels this CPU can run, the scalar reference first."""
    lib = library()
    return [name for i, name in enumerate(ISAS) if lib.specc_isa_supported(i)]


def best_isa() -> str:
    return ISAS[library().specc_best_isa()]


def active_isa() -> str:
    """The kernel ONNX Runtime's Int4Gemm runs here: SPECC_KERNEL_ISA where this CPU has it, else the best."""
    wanted = os.environ.get("SPECC_KERNEL_ISA")
    if wanted is not None and wanted not in ISAS:
        raise SpeccError(f"SPECC_KERNEL_ISA={wanted!r} names no kernel; allowed: {', '.join(ISAS)}")
    return wanted if wanted in supported_isas() else best_isa()


def dot_peak(isa: str | None = None, threads: int = 1, iterations: int = 20_000_000) -> float:
    """GMAC/s of one ISA's integer dot instructions (the kernels' own: vpdpbusd, or vpmaddubsw + vpmaddwd) on
    `threads` threads, registers only: the compute roof a verify pass is measured against."""
    import threading
    import time

    lib = library()
    lib.specc_dot_peak.restype = ctypes.c_longlong
    lib.specc_dot_peak.argtypes = [ctypes.c_int, ctypes.c_longlong]
    index = ISAS.index(isa or best_isa())
    done = [0] * threads

    def work(i: int) -> None:
        done[i] = lib.specc_dot_peak(index, iterations)

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    start = time.perf_counter()
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    return sum(done) / (time.perf_counter() - start) / 1e9


def register_with(session_options) -> None:
    """Make Int4Gemm available to sessions built with these onnxruntime.SessionOptions."""
    library()
    session_options.register_custom_ops_library(str(library_path()))


def aligned_empty(shape: tuple[int, ...]) -> np.ndarray:
    """An uninitialised float32 array on a 64-byte boundary, as ONNX Runtime and torch allocate tensors (the kernels
    write large aligned outputs with whole-line stores, and read aligned caches faster)."""
    count = int(np.prod(shape))
    raw = np.empty(count + 16, np.float32)
    start = (-raw.ctypes.data % 64) // 4
    return raw[start:start + count].reshape(shape)


def _kernel_isa(isa: str | None) -> str:
    """The ISA a kernel call runs on: the one named, or the best here."""
    isa = isa or best_isa()
    if isa not in ISAS:
        raise SpeccError(f"no kernel {isa!r}; allowed: {', '.join(ISAS)}")
    return isa


def _not_here(isa: str) -> SpeccError:
    return SpeccError(f"kernel {isa} does not run on this CPU; here: {', '.join(supported_isas())}")


def gemm(x: np.ndarray, w: PackedInt4, isa: str | None = None, threads: int = 1, glu: bool = False) -> np.ndarray:
    """y [m, n] = x [m, k] float32 times the packed weight, on one ISA's kernel (default: the best here); glu: the
    weight's rows are a gated MLP's gate and up projections, and y [m, n / 2] is `swiglu` of the product's halves."""
    lib, isa = library(), _kernel_isa(isa)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != w.k:
        raise SpeccError(f"x must be [m, {w.k}], got {list(x.shape)}")
    if glu and w.n % 32:
        raise SpeccError(f"a gated product needs the weight's rows in two halves of a multiple of 16, got {w.n}")
    y = aligned_empty((x.shape[0], w.n // 2 if glu else w.n))
    rc = lib.specc_int4_gemm(ISAS.index(isa), x.ctypes.data, x.shape[0], w.data.ctypes.data, w.n, w.k, int(w.offsets),
                             y.ctypes.data, threads, int(glu))
    if rc != 0:
        raise _not_here(isa)
    return y


def swiglu(gate: np.ndarray, up: np.ndarray, isa: str | None = None) -> np.ndarray:
    """silu(gate) * up elementwise, in float32, with the bits csrc/glu.h defines, on one ISA's kernel."""
    lib, isa = library(), _kernel_isa(isa)
    gate, up = (np.ascontiguousarray(a, dtype=np.float32) for a in (gate, up))
    if gate.shape != up.shape:
        raise SpeccError(f"swiglu: gate and up must have one shape, got {list(gate.shape)} and {list(up.shape)}")
    y = np.empty_like(gate)
    if lib.specc_swiglu(ISAS.index(isa), gate.ctypes.data, up.ctypes.data, y.ctypes.data, gate.size) != 0:
        raise _not_here(isa)
    return y


def cache_attention(q: np.ndarray, k_new: np.ndarray, v_new: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                    mask: np.ndarray, cache_len: np.ndarray, positions: np.ndarray, scale: float,
                    isa: str | None = None, threads: int = 1) -> np.ndarray:
    """CacheAttention (csrc/attention.h) on one ISA's kernel: q [B, Hq, T, D], k_new / v_new [B, Hkv, T, D],
    k_cache / v_cache [B, Hkv, S, D], mask bool [1|B, 1|Hq, T, S + T], cache_len [B], positions [B, T];
    returns [B, Hq, T, D]."""
    lib, isa = library(), _kernel_isa(isa)
    f32 = [np.ascontiguousarray(a, dtype=np.float32) for a in (q, k_new, v_new, k_cache, v_cache)]
    mask = np.ascontiguousarray(mask, dtype=np.bool_)
    cache_len, positions = (np.ascontiguousarray(a, dtype=np.int64) for a in (cache_len, positions))
    (b, hq, t, d), (hkv, s) = f32[0].shape, (f32[1].shape[1], f32[3].shape[2])
    if (f32[1].shape != (b, hkv, t, d) or f32[2].shape != f32[1].shape or f32[3].shape != (b, hkv, s, d)
            or f32[4].shape != f32[3].shape or mask.ndim != 4 or mask.shape[2:] != (t, s + t)
            or cache_len.shape != (b,) or positions.shape != (b, t)):
        raise SpeccError("cache_attention: shapes must be q [B, Hq, T, D], k_new and v_new [B, Hkv, T, D], k_cache "
                         "and v_cache [B, Hkv, S, D], mask [1|B, 1|Hq, T, S + T], cache_len [B], positions [B, T]")
    out = np.empty_like(f32[0])
    rc = lib.specc_cache_attention(ISAS.index(isa), *(a.ctypes.data for a in f32), mask.ctypes.data,
                                   cache_len.ctypes.data, positions.ctypes.data, b, hq, hkv, t, s, d,
                                   mask.shape[0], mask.shape[1], scale, out.ctypes.data, threads)
    if rc == -1:
        raise _not_here(isa)
    if rc == -2:
        raise SpeccError("cache_attention: the kernel refuses these arguments (heads, head size a multiple of 16 up "
                         "to 256, positions in [cache_len, cache_len + T) inside the cache)")
    return out


__all__ = [
    "ATTENTION_OP", "DOMAIN", "ISAS", "LAYOUT", "OP", "KernelsUnavailable", "PackedInt4", "active_isa", "aligned_empty",
    "available", "best_isa", "cache_attention", "dot_peak", "gemm", "library", "library_path", "pack_int4",
    "register_with", "supported_isas", "swiglu"
]
