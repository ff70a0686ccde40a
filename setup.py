"""Builds specc's kernel library (specc/kernels/csrc) with the package; the rest of the metadata is pyproject.toml's.

The library is a plain shared object that Python opens with ctypes and ONNX Runtime with
register_custom_ops_library. It is optional: where no C++ compiler is found specc installs without it, and the
recipes that need it (target.quantize: int4-gemm) say so when compiled or loaded.
"""
from pathlib import Path

from setuptools import Extension, setup

CSRC = Path("specc/kernels/csrc")

setup(ext_modules=[Extension(
    "specc.kernels._specc_kernels",
    sources=sorted(str(p) for p in CSRC.glob("*.cpp")),
    depends=sorted(str(p) for p in CSRC.glob("*.h*")) + sorted(str(p) for p in CSRC.glob("*.inc")),
    # no contraction of a * b + c into an fma: the kernels' bits must not depend on the compiler's choices
    extra_compile_args=["-O3", "-std=c++17", "-ffp-contract=off"],
    extra_link_args=["-lpthread"],
    language="c++",
    optional=True,
)])
