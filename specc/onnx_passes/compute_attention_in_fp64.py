"""compute_attention_in_fp64: ONNX `Attention` nodes compute in float64, so that a row's result does not
depend on how many tokens the pass holds or where its keys sit.

ONNX Runtime's float32 attention picks different GEMM kernels for one query row (decode) and
several (verify, prefill), and a pass over [cache ; new tokens] puts a token's key at another index
than the pass after it; the sums differ by ~1e-6. In a float32 graph that stays ~1e-6. In a
quantised graph the next layer quantises its activations to int8, and a 1e-6 change that crosses a
rounding boundary becomes a whole quantum (~1e-2): the target's greedy token after a k+1-token verify
could differ from the one a 1-token pass picks. In float64 the error is ~1e-16, and rounding back to
float32 removes it. It casts the whole cache every pass, so it is the fallback for the graphs
attend_at_cache_positions cannot rewrite (trees, attention sinks).

ensures: no 4-D, mask-only `Attention` node left computing in float32 (causal or soft-capped ones,
  which this rewrite does not decompose, stay as they are).
"""
from __future__ import annotations

from .base import OnnxPass, OnnxProperty
from .grouped_attention import (DOUBLE, FLOAT, grouped_attention, is_bool, no_float32_attention, replace_nodes, rewritable,
                                scale_of)


class ComputeAttentionInFp64(OnnxPass):
    """Attention in float64 (cast in, decomposed, cast out): rows independent of the pass size."""

    name = "compute_attention_in_fp64"
    ensures = (OnnxProperty("no-float32-attention", no_float32_attention,
                            "no 4-D, mask-only Attention node computing in float32"),)

    def apply(self, model) -> dict:
        """Manifest facts: {"attention_float64": nodes rewritten}."""
        from onnx import helper

        def rewrite(node) -> list | None:
            heads = rewritable(model, node)
            if heads is None:
                return None
            p = f"{node.name}.fp64"
            t = lambda s: f"{p}.{s}"  # noqa: E731
            q, k, v = node.input[:3]
            mask = node.input[3] if len(node.input) == 4 else None
            nodes = [helper.make_node("Cast", [x], [t(x_name)], to=DOUBLE) for x, x_name in ((q, "q"), (k, "k"), (v, "v"))]
            nodes += grouped_attention(model, t, t("q"), t("k"), t("v"), mask, bool(mask) and is_bool(model, mask),
                                       heads, scale_of(node), t("o"), DOUBLE)
            nodes.append(helper.make_node("Cast", [t("o")], [node.output[0]], to=FLOAT))
            for i, n in enumerate(nodes):
                n.name = f"{p}.{i}"
            return nodes

        replaced = replace_nodes(model, rewrite)
        return {"attention_float64": replaced}
