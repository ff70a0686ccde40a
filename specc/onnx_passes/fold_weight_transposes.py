"""fold_weight_transposes: Transpose(constant weight) becomes a transposed constant.

ensures: no Transpose reads an initializer, so the quantising passes see every linear layer's weight
  as a constant; a tied LM head (a Transpose of the embedding) gets quantised too.
"""
from __future__ import annotations

import numpy as np

from .base import OnnxPass
from .linear_layers import WEIGHT_TRANSPOSES_FOLDED


class FoldWeightTransposes(OnnxPass):
    """Transposes of constant weights folded into transposed constants."""

    name = "fold_weight_transposes"
    ensures = (WEIGHT_TRANSPOSES_FOLDED,)

    def apply(self, model) -> dict:
        from onnx import numpy_helper

        inits = {i.name: i for i in model.graph.initializer}
        for node in list(model.graph.node):
            if node.op_type != "Transpose" or node.input[0] not in inits:
                continue
            perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
            array = numpy_helper.to_array(inits[node.input[0]])
            folded = numpy_helper.from_array(np.ascontiguousarray(array.transpose(perm)), node.output[0])
            model.graph.initializer.append(folded)
            model.graph.node.remove(node)
        return {}
