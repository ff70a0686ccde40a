"""attend_with_cache_kernel: a chain or tree graph's `Attention` nodes over [cache ; new] keys become specc's
`ai.specc::CacheAttention`, one operator that reads each new key at its token's position without copying the cache
(specc/kernels/csrc/attention.h).

attend_at_cache_positions gives a row the same bits in a pass of any size by writing the new keys into a copy of
each layer's cache and attending over the copy in a dozen small operators. On a few cores, those copies and the
operators' dispatch are a large share of a decode step of a 4-bit model. The kernel keeps the same contract (a
query's result depends on its own keys, values and mask row alone) and skips masked slots instead of computing them.
In a token tree a node's slots hold its ancestors, so a verified path has a chain's bits without the float64
attention compute_attention_in_fp64 would otherwise give tree graphs.
It is part of specc's kernel library, which only the sessions of `target.quantize: int4-gemm` graphs register, so
only their pipeline runs this pass.

requires: nothing (a graph without `cache_len` and `position_ids` inputs is left as it is, and so are nodes whose
  head size is not a multiple of 16 up to 256: attend_at_cache_positions or compute_attention_in_fp64 takes them).
ensures:  in a graph with cache positions, no Attention node over [cache ; new] keys whose head size the kernel takes.
"""
from __future__ import annotations

from ..kernels import ATTENTION_OP, DOMAIN
from .attend_at_cache_positions import cache_attention_parts, drop_unused_concats
from .base import OnnxPass, OnnxProperty
from .grouped_attention import replace_nodes, scale_of

LANES, MAX_HEAD = 16, 256


def _head_size(model, cache: str) -> int | None:
    """The last dimension of a cache graph input [B, H, S, D], where it is fixed."""
    for i in model.graph.input:
        if i.name == cache:
            dims = i.type.tensor_type.shape.dim
            return dims[3].dim_value or None if len(dims) == 4 else None
    return None


def _kernel_takes(model, node) -> bool:
    parts = cache_attention_parts(model, node)
    if parts is None:
        return False
    d = _head_size(model, parts[1][0])
    return d is not None and d % LANES == 0 and d <= MAX_HEAD


def _has_cache_positions(model) -> bool:
    return {"cache_len", "position_ids"} <= {i.name for i in model.graph.input}


def _none_left(model, _pass) -> bool:
    return not _has_cache_positions(model) or not any(_kernel_takes(model, n) for n in model.graph.node)


class AttendWithCacheKernel(OnnxPass):
    """Attention over [cache ; new] onto one CacheAttention operator per layer, in chain and tree graphs."""

    name = "attend_with_cache_kernel"
    ensures = (OnnxProperty("attention-in-kernel", _none_left,
                            "no Attention over [cache ; new] keys the CacheAttention kernel takes left"),)

    def apply(self, model) -> dict:
        """Manifest facts: {"attention_in_kernel": nodes replaced}."""
        from onnx import helper

        if not _has_cache_positions(model):
            return {"attention_in_kernel": 0}

        def rewrite(node) -> list | None:
            if not _kernel_takes(model, node):
                return None
            _, (cache_k, new_k), (cache_v, new_v) = cache_attention_parts(model, node)
            return [helper.make_node(ATTENTION_OP, [node.input[0], new_k, new_v, cache_k, cache_v, node.input[3],
                                                    "cache_len", "position_ids"], [node.output[0]],
                                     name=f"{node.name}.cache_kernel", domain=DOMAIN, scale=scale_of(node))]

        replaced = replace_nodes(model, rewrite)
        drop_unused_concats(model)
        if replaced and not any(o.domain == DOMAIN for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
        return {"attention_in_kernel": replaced}
