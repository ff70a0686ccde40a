"""Block-quantised weights: the number format GGUF files store and the quantising ONNX rewrites emit.

A weight W [N out, K in] is stored as blocks of `block_size` consecutive inputs of one output row:

    W[n, k] = (q[n, k] - zp[n, b]) * scale[n, b] + offset[n, b]        b = k // block_size

q has `bits` bits (4 or 8), zp is an integer zero point, `offset` an optional float per block
(GGUF's Q4_1/Q4_K minimums, which no integer zero point can express). `BlockWeight.dequantize`
evaluates it in float32 in the order ggml dequantises, so GGUF blocks kept as stored dequantise
bit for bit to what gguf-py and llama.cpp give.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class BlockWeight:
    bits: int
    block_size: int
    q: np.ndarray  # uint8 [N, n_blocks, block_size], values < 2**bits (K padded with zero weights)
    scales: np.ndarray  # float32 [N, n_blocks]
    zero_points: np.ndarray  # uint8 [N, n_blocks]
    k: int  # real input size (q may be padded up to whole blocks)
    offsets: np.ndarray | None = None  # float32 [N, n_blocks], added to every weight of the block
    source: str = "rtn"  # "rtn" (quantised here from float weights) or "gguf:<type>" (blocks kept as stored)

    @property
    def n(self) -> int:
        return self.q.shape[0]

    def dequantize(self) -> np.ndarray:
        """The float32 weight [N, K] the quantised graph multiplies by."""
        w = (self.q.astype(np.float32) - self.zero_points[..., None].astype(np.float32)) * self.scales[..., None]
        if self.offsets is not None:
            w = w + self.offsets[..., None]
        return w.reshape(self.n, -1)[:, : self.k]

    def nbytes(self) -> int:
        """Bytes a pass reads for this weight: packed values, scales, zero points, offsets."""
        n_blocks = self.q.shape[1]
        zp = self.n * ((n_blocks * self.bits + 7) // 8)
        off = self.offsets.nbytes if self.offsets is not None else 0
        return self.q.size * self.bits // 8 + self.scales.nbytes + zp + off


def exact_match(candidates, w: np.ndarray) -> BlockWeight | None:
    """The first of the candidate blocks (a GGUF's, as imported) that dequantises bit for bit to the float weight
    w [N, K], if any."""
    for bw in candidates:
        if bw.n == w.shape[0] and bw.k == w.shape[1] and np.array_equal(bw.dequantize(), w):
            return bw
    return None


def quantize_rtn(w: np.ndarray, bits: int, block_size: int, symmetric: bool = True) -> BlockWeight:
    """Round-to-nearest block quantisation of a float weight [N, K].

    symmetric: zero point 2**(bits-1) and scale max/-2**(bits-1) from the signed largest-magnitude
    value (the Q4_0/Q8_0 rule: all 2**bits levels used); asymmetric: scale (max-min)/(2**bits-1)
    and an integer zero point.
    """
    w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    n_blocks = -(-k // block_size)
    padded = np.zeros((n, n_blocks * block_size), np.float32)
    padded[:, :k] = w
    blocks = padded.reshape(n, n_blocks, block_size)
    levels = (1 << bits) - 1
    if symmetric:
        idx = np.abs(blocks).argmax(-1)[..., None]
        peak = np.take_along_axis(blocks, idx, -1)[..., 0]
        scales = peak / -(1 << (bits - 1))
        zp = np.full((n, n_blocks), 1 << (bits - 1), np.uint8)
    else:
        lo, hi = np.minimum(blocks.min(-1), 0), np.maximum(blocks.max(-1), 0)
        scales = (hi - lo) / levels
        with np.errstate(divide="ignore", invalid="ignore"):
            zp = np.clip(np.rint(np.where(scales == 0, 0, -lo / scales)), 0, levels).astype(np.uint8)
    scales = scales.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(scales == 0, 0, 1 / scales).astype(np.float32)
    q = np.clip(np.rint(blocks * inv[..., None]) + zp[..., None], 0, levels).astype(np.uint8)
    return BlockWeight(bits, block_size, q, scales, zp, k)
