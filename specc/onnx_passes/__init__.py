"""ONNX passes: rewrites of a backend's exported ONNX graph, one per module, run in an explicit order."""
from __future__ import annotations

from .base import OnnxPass, OnnxPassContractError, run_onnx_passes
from .attend_at_cache_positions import AttendAtCachePositions
from .attend_with_cache_kernel import AttendWithCacheKernel
from .compute_attention_in_fp64 import ComputeAttentionInFp64
from .feed_cache_by_layer import FeedCacheByLayer
from .fold_weight_transposes import FoldWeightTransposes
from .gate_in_int4_gemm import GateInInt4Gemm
from .linear_layers import QuantConfig
from .quantize_int4_gemm import QuantizeInt4Gemm
from .quantize_int8_gemm import QuantizeInt8Gemm
from .quantize_matmul_nbits import QuantizeMatMulNBits
from .quantize_weight_only_dq import QuantizeWeightOnlyDQ


# What the manifest records (weight_quant) of the nodes a quantised target graph computes one way or another: the forms
# of attention (with how `specc inspect` words them), and a SwiGLU gated in Int4Gemm. Targets that differ in them
# differ in their outputs' last bits.
ATTENTION_FORMS = {"attention_in_kernel": "in specc's CacheAttention kernel",
                   "attention_at_positions": "keys at their positions in float32",
                   "attention_float64": "in float64"}
NUMERIC_FORMS = (*ATTENTION_FORMS, "gated_in_kernel")


def onnxruntime_target_pipeline(config: QuantConfig) -> list[OnnxPass]:
    """A quantised target on ONNX Runtime: linear layers onto MatMulNBits (the integer GEMM for int8-gemm, specc's
    own int4 kernel for int4-gemm, which also gates a SwiGLU MLP's product), attention with keys at their positions
    (in specc's own kernel for int4-gemm, whose sessions register it; else in float32 operators), or in float64 where
    that rewrite does not apply (the k+1-token verify then sees the numbers a 1-token decode sees)."""
    quantize = {"int8-gemm": QuantizeInt8Gemm, "int4-gemm": QuantizeInt4Gemm}.get(config.kind, QuantizeMatMulNBits)(config)
    own_kernels = [GateInInt4Gemm(), AttendWithCacheKernel()] if config.kind == "int4-gemm" else []
    return [FoldWeightTransposes(), quantize, *own_kernels, AttendAtCachePositions(), ComputeAttentionInFp64()]


def tensorrt_target_pipeline(config: QuantConfig) -> list[OnnxPass]:
    """A quantised target on TensorRT: linear layers into the DequantizeLinear → MatMul form TensorRT fuses."""
    return [FoldWeightTransposes(), QuantizeWeightOnlyDQ(config)]


ALL_ONNX_PASSES: list[type[OnnxPass]] = [FeedCacheByLayer, FoldWeightTransposes, QuantizeMatMulNBits, QuantizeInt8Gemm,
                                         QuantizeInt4Gemm, QuantizeWeightOnlyDQ, GateInInt4Gemm, AttendWithCacheKernel,
                                         AttendAtCachePositions, ComputeAttentionInFp64]


def describe_onnx_passes() -> str:
    """Every ONNX pass with its contract, for `specc passes`."""
    from ..passes.base import describe_contracts  # here, not at the top: importing the FX passes loads torch

    return describe_contracts(ALL_ONNX_PASSES)


__all__ = ["ALL_ONNX_PASSES", "ATTENTION_FORMS", "AttendAtCachePositions", "AttendWithCacheKernel", "FeedCacheByLayer",
           "GateInInt4Gemm", "NUMERIC_FORMS", "OnnxPass", "OnnxPassContractError", "QuantConfig",
           "describe_onnx_passes", "onnxruntime_target_pipeline", "run_onnx_passes", "tensorrt_target_pipeline"]
