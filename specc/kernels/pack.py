"""The packed weight format of the Int4Gemm kernels (csrc/q4gemm.h), written from a BlockWeight.

A weight is q * scale + offset per block of 32 inputs, q in 0..15. Panels of 16 output columns; a panel holds each
block's 256 bytes of nibbles in order (chunk h of 64 bytes: byte 4c + i has column c's input 8h + i in its low
nibble and input 8h + 4 + i in its high nibble), then the fp16 scales [block][column], then the fp16 offsets.
Symmetric weights (zero point 8, no offset: GGUF's Q4_0, round to nearest here) leave the offsets out and the kernel
uses -8 * scale.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..block_weights import BlockWeight

BLOCK = 32
PANEL = 16
LAYOUT = 2  # the Int4Gemm operator's `layout` attribute (csrc/q4gemm.h kLayoutVersion)
FP16_MAX = float(np.finfo(np.float16).max)


@dataclass
class PackedInt4:
    data: np.ndarray  # uint8, the packed bytes
    n: int
    k: int
    offsets: bool


def packable(bw: BlockWeight) -> bool:
    """Is this a 4-bit weight in blocks of 32, the one format the kernels take?"""
    return bw.bits == 4 and bw.block_size == BLOCK


def _offsets(bw: BlockWeight) -> np.ndarray | None:
    """The float offset per block of the kernels' form q * scale + offset, or None for symmetric blocks (zero point
    8, no offset), which the kernels read as -8 * scale."""
    if bw.offsets is None and bool(np.all(bw.zero_points == 8)):
        return None
    scales = bw.scales.astype(np.float32)
    return (bw.offsets if bw.offsets is not None else np.zeros_like(scales)) - bw.zero_points.astype(np.float32) * scales


def pack_int4(bw: BlockWeight) -> PackedInt4:
    """The kernels' bytes for a 4-bit, block-32 weight; ValueError for another format or scales beyond fp16."""
    if not packable(bw):
        raise ValueError(f"Int4Gemm packs 4-bit weights in blocks of {BLOCK}, not {bw.bits}-bit blocks of {bw.block_size}")
    n, blocks = bw.scales.shape
    scales, offsets = bw.scales.astype(np.float32), _offsets(bw)
    symmetric = offsets is None
    for name, values in (("scale", scales), ("offset", offsets)):
        if values is not None and (not np.all(np.isfinite(values)) or np.abs(values).max(initial=0) > FP16_MAX):
            raise ValueError(f"a block {name} is not finite or beyond fp16's range")
    panels = -(-n // PANEL)
    pad = panels * PANEL - n
    q = np.pad(bw.q, ((0, pad), (0, 0), (0, 0))).reshape(panels, PANEL, blocks, 4, 2, 4)  # [.., chunk, half, input]
    nibbles = (q[..., 0, :] | (q[..., 1, :] << 4)).astype(np.uint8)  # [panels, column, block, chunk, input]
    parts = [nibbles.transpose(0, 2, 3, 1, 4).reshape(panels, blocks * PANEL * BLOCK // 2)]
    for values in (scales, offsets):
        if values is not None:
            halves = np.pad(values, ((0, pad), (0, 0))).reshape(panels, PANEL, blocks).transpose(0, 2, 1)
            parts.append(np.ascontiguousarray(halves).astype(np.float16).view(np.uint8).reshape(panels, -1))
    data = np.ascontiguousarray(np.concatenate(parts, axis=-1)).reshape(-1)
    return PackedInt4(data, n, bw.k, not symmetric)


def dequantize(bw: BlockWeight) -> np.ndarray:
    """The float32 weight [N, K] the kernels multiply by (fp16 scales and offsets, as packed)."""
    scales = bw.scales.astype(np.float16).astype(np.float32)
    offsets = _offsets(bw)
    offsets = -8 * scales if offsets is None else offsets.astype(np.float16).astype(np.float32)
    w = bw.q.astype(np.float32) * scales[..., None] + offsets[..., None]
    return w.reshape(bw.n, -1)[:, :bw.k]


def quantized_activations(x: np.ndarray) -> np.ndarray:
    """x [..., K] as the kernels multiply it, in float32: int8 per row and superblock of 256 inputs (8 blocks of 32;
    the last may be shorter), scale max|x| / 127, rounded half to even (csrc/q4gemm.h)."""
    x = np.asarray(x, dtype=np.float32)
    k = x.shape[-1]
    padded = np.concatenate([x, np.zeros(x.shape[:-1] + (-k % BLOCK,), np.float32)], axis=-1)
    parts = []
    for lo in range(0, padded.shape[-1], 8 * BLOCK):
        chunk = padded[..., lo:lo + 8 * BLOCK]
        amax = np.abs(chunk).max(-1, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(amax > 0, np.rint(chunk * (np.float32(127) / amax)), np.float32(0))
        parts.append(np.clip(q, -127, 127).astype(np.float32) * (amax / np.float32(127)))
    return np.concatenate(parts, axis=-1)[..., :k]
