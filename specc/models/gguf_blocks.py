"""GGUF quantised blocks → `BlockWeight`s, kept as stored (no second rounding).

Formats whose blocks map exactly onto MatMulNBits (with an offset term where GGUF has minimums):

    Q4_0  block 32: d·(q-8)                      → 4 bits, zero point 8
    Q4_1  block 32: d·q + m                      → 4 bits, zero point 0, offset m
    Q8_0  block 32: d·q, q signed                → 8 bits, zero point 128
    Q4_K  256 = 8×32: (d·sc_j)·q - dmin·m_j      → 4 bits, block 32, offset -dmin·m_j
    Q6_K  256 = 16×16: (d·sc_j)·(q-32)           → 8 bits (6 used), block 16, zero point 32

Every product d·sc_j and dmin·m_j is exact in float32 (an fp16 times a small integer), so the
block scales and offsets are the GGUF's own numbers and `BlockWeight.dequantize` gives gguf-py's
dequantised values bit for bit. Other types (F16, Q5_*, IQ*, ...) are not imported: those layers
are quantised from the full-precision weights.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..block_weights import BlockWeight
from ..recipe import GGUF_BLOCK_TYPES

QK_K = 256
IMPORTABLE = GGUF_BLOCK_TYPES
BITS = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q8_0": 8, "Q6_K": 8}
_MODULE_TO_GGUF = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)[..., 0]


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """ggml's 4-bit layout: in each run of `width` bytes, low nibbles are values 0..width-1, high nibbles the next width."""
    lead = qs.shape[:-1]
    qs = qs.reshape(*lead, -1, 1, width) >> np.array([0, 4], np.uint8).reshape(2, 1)
    return (qs & 0x0F).reshape(*lead, -1)


def blocks_to_weight(kind: str, raw: np.ndarray, k: int) -> BlockWeight:
    """One GGUF tensor's raw bytes [N rows, bytes per row] → BlockWeight [N, K]."""
    n = raw.shape[0]
    if kind in ("Q4_0", "Q4_1", "Q8_0"):
        size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind]
        b = raw.reshape(n, k // 32, size)
        d = _f16(b[..., 0:2])
        if kind == "Q8_0":
            q = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
            return BlockWeight(8, 32, q, d, np.full(d.shape, 128, np.uint8), k, source="gguf:Q8_0")
        head = 2 if kind == "Q4_0" else 4
        q = _nibbles(b[..., head:], 16).astype(np.uint8)
        if kind == "Q4_0":
            return BlockWeight(4, 32, q, d, np.full(d.shape, 8, np.uint8), k, source="gguf:Q4_0")
        return BlockWeight(4, 32, q, d, np.zeros(d.shape, np.uint8), k, offsets=_f16(b[..., 2:4]), source="gguf:Q4_1")
    if kind == "Q4_K":
        from gguf.quants import Q4_K

        b = raw.reshape(n * (k // QK_K), 144)
        d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
        sc, mins = Q4_K.get_scale_min(b[:, 4:16])
        scales = (d[:, None] * sc.astype(np.float32)).reshape(n, -1)
        offsets = -(dmin[:, None] * mins.astype(np.float32)).reshape(n, -1)
        q = _nibbles(b[:, 16:], 32).reshape(n, -1, 32).astype(np.uint8)
        return BlockWeight(4, 32, q, scales, np.zeros(scales.shape, np.uint8), k, offsets=offsets, source="gguf:Q4_K")
    if kind == "Q6_K":
        b = raw.reshape(n * (k // QK_K), 210)
        ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208].view(np.int8), _f16(b[:, 208:210])
        low = _nibbles(ql.reshape(-1, 2, 64), 64).reshape(-1, 2, 4, 32)  # [block, half, quarter, 32]
        high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 0x03
        q = (low | (high << 4)).reshape(n, -1, 16).astype(np.uint8)
        scales = (d[:, None] * sc.astype(np.float32)).reshape(n, -1)
        return BlockWeight(8, 16, q, scales, np.full(scales.shape, 32, np.uint8), k, source="gguf:Q6_K")
    raise ValueError(f"GGUF type {kind} has no exact MatMulNBits form; importable: {', '.join(IMPORTABLE)}")


def _rows(bw: BlockWeight, order: np.ndarray) -> BlockWeight:
    return BlockWeight(bw.bits, bw.block_size, bw.q[order], bw.scales[order], bw.zero_points[order], bw.k,
                       None if bw.offsets is None else bw.offsets[order], bw.source)


def _unpermute_rows(n: int, heads: int) -> np.ndarray:
    """Row order undoing llama.cpp's rotary permutation of Llama q/k weights (what transformers applies)."""
    return np.arange(n).reshape(heads, n // heads // 2, 2).swapaxes(1, 2).reshape(n)


def gguf_tensor_name(module: str, tied: bool) -> str | None:
    """GGUF tensor name of a StepDecoder linear module (layers.3.mlp.up_proj → blk.3.ffn_up.weight)."""
    if module == "lm_head":
        return "token_embd.weight" if tied else "output.weight"
    parts = module.split(".")
    if len(parts) >= 4 and parts[0] == "layers" and ".".join(parts[2:]) in _MODULE_TO_GGUF:
        return f"blk.{parts[1]}.{_MODULE_TO_GGUF['.'.join(parts[2:])]}.weight"
    return None


def read_gguf_blocks(path: str | Path, min_bits: int, skip: tuple[str, ...] = ()) -> dict[str, list[BlockWeight]]:
    """Module name → candidate BlockWeights (the stored row order, and for q/k the un-permuted one) for
    every linear layer stored in an importable type of at least `min_bits` bits, except the types in `skip`."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()

    def meta(key: str) -> int | None:
        f = reader.fields.get(f"{arch}.{key}")
        return int(f.parts[-1][0]) if f is not None else None

    heads, kv_heads = meta("attention.head_count"), meta("attention.head_count_kv")
    tied = "output.weight" not in tensors
    n_layers = meta("block_count") or 0
    modules = ["lm_head"] + [f"layers.{i}.{m}" for i in range(n_layers) for m in _MODULE_TO_GGUF]
    out: dict[str, list[BlockWeight]] = {}
    for module in modules:
        t = tensors.get(gguf_tensor_name(module, tied))
        kind = t.tensor_type.name if t is not None else None
        if kind not in IMPORTABLE or BITS[kind] < min_bits or kind in skip:
            continue
        k = int(t.shape[0])
        bw = blocks_to_weight(kind, np.asarray(t.data).reshape(int(t.shape[1]), -1), k)
        candidates = [bw]
        head_count = heads if module.endswith("q_proj") else kv_heads if module.endswith("k_proj") else None
        if head_count and bw.n % (2 * head_count) == 0:
            candidates.append(_rows(bw, _unpermute_rows(bw.n, head_count)))
        out[module] = candidates
    return out
