"""What an ONNX pass is: a named in-place rewrite of an exported ONNX model that states its contract.

The second pass layer: the FX passes (specc/passes) rewrite step graphs before export, these
rewrite the ONNX a backend exports, for that backend's kernels. As there, `requires` and
`ensures` name graph properties checked before and after the rewrite, so a pipeline in the wrong
order fails at compile time with a message naming the pass, not with a wrong engine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class OnnxProperty:
    name: str
    check: Callable[[Any, "OnnxPass"], bool]  # (onnx.ModelProto, the pass checking it): a pass's settings may matter
    doc: str


class OnnxPass:
    """Subclasses set name/requires/ensures and implement `apply`, which edits the model in place."""

    name: str = ""
    requires: tuple[OnnxProperty, ...] = ()
    ensures: tuple[OnnxProperty, ...] = ()

    def apply(self, model) -> dict:
        """Rewrite the model; return what the bundle's manifest records about the rewrite (may be empty)."""
        raise NotImplementedError

    def __call__(self, model) -> dict:
        for prop in self.requires:
            if not prop.check(model, self):
                raise OnnxPassContractError(f"ONNX pass {self.name} requires {prop.doc}, which the graph lacks")
        facts = self.apply(model)
        for prop in self.ensures:
            if not prop.check(model, self):
                raise OnnxPassContractError(f"ONNX pass {self.name} promised {prop.doc} but did not deliver it")
        return facts


def run_onnx_passes(model, passes: list[OnnxPass]) -> dict:
    """Run the passes in order on the model (in place); their manifest facts merged, later ones winning."""
    facts: dict = {}
    for p in passes:
        facts.update(p(model))
    return facts


class OnnxPassContractError(RuntimeError):
    """An ONNX pass ran on a graph that does not meet its contract (a pipeline-ordering bug)."""
