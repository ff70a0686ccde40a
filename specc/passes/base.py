"""What a graph pass is: a named rewrite of a StepGraph that states its contract.

`requires` and `ensures` name graph properties (inputs, outputs, structures) checked
before and after the pass, so a pipeline in the wrong order fails at compile time with
a message naming the pass, not with a wrong engine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..capture.graph import StepGraph

PASS_TAG = "specc_pass"  # key in an FX node's meta["custom"]: the pass that created the node


@dataclass(frozen=True)
class GraphProperty:
    name: str
    check: Callable[[StepGraph], bool]
    doc: str


def has_input(name: str) -> GraphProperty:
    return GraphProperty(f"input:{name}", lambda g: any(i.name == name for i in g.inputs), f"graph input {name!r}")


def has_output(name: str) -> GraphProperty:
    return GraphProperty(f"output:{name}", lambda g: name in g.outputs, f"graph output {name!r}")


def lacks_output(name: str) -> GraphProperty:
    return GraphProperty(f"no-output:{name}", lambda g: name not in g.outputs, f"no graph output {name!r}")


class GraphPass:
    """Subclasses set name/requires/ensures and implement `apply`, which edits the graph in place."""

    name: str = ""
    requires: tuple[GraphProperty, ...] = ()
    ensures: tuple[GraphProperty, ...] = ()

    def apply(self, graph: StepGraph) -> str:
        """Rewrite graph; return one line saying what changed."""
        raise NotImplementedError

    def __call__(self, graph: StepGraph) -> str:
        for prop in self.requires:
            if not prop.check(graph):
                raise PassContractError(f"pass {self.name} requires {prop.doc} in the {graph.role} graph, which it lacks")
        before = set(graph.gm.graph.nodes)
        note = self.apply(graph)
        graph.finish_edit()
        tag_new_nodes(graph, before, self.name)
        for prop in self.ensures:
            if not prop.check(graph):
                raise PassContractError(f"pass {self.name} promised {prop.doc} in the {graph.role} graph but did not deliver it")
        graph.notes.append(f"{self.name}: {note}")
        return note


def tag_new_nodes(graph: StepGraph, before: set, pass_name: str) -> None:
    """Record on every node the pass created which pass that was (`meta["custom"][PASS_TAG]`).

    torch.export keeps `meta["custom"]` when the graph is exported again, and the ONNX export
    copies it onto the ONNX nodes (backends/onnx_export.py), so a backend that rejects a node
    can name the pass that produced it.
    """
    for node in graph.gm.graph.nodes:
        if node not in before:
            node.meta.setdefault("custom", {})[PASS_TAG] = pass_name


class PassContractError(RuntimeError):
    """A pass ran on a graph that does not meet its contract (a pipeline-ordering bug)."""


def describe_contracts(passes: list[type]) -> str:
    """Each pass class with its first docstring line and its requires/ensures (`specc passes`); FX and ONNX
    passes alike, whose contract entries carry a `doc`."""
    lines = []
    for cls in passes:
        lines.append(f"{cls.name}: {(cls.__doc__ or '').strip().splitlines()[0]}")
        lines.append(f"  requires: {', '.join(r.doc for r in cls.requires) or '-'}")
        lines.append(f"  ensures:  {', '.join(e.doc for e in cls.ensures) or '-'}")
    return "\n".join(lines) if lines else "no passes registered"
