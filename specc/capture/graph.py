"""StepGraph: an exported step graph as an editable FX GraphModule plus its I/O contract.

Passes edit `gm` (adding inputs, outputs and nodes); `export()` traces the edited module
again with `torch.export`, so every backend lowers an ordinary ExportedProgram.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.export import Dim, ExportedProgram
from torch.fx import GraphModule, Node

from .blocks.norms import norm_facts
from .shapes import AXES, DimRanges, ModelDims, example_inputs
from .step_decoder import INPUT_NAMES, OUTPUT_NAMES, StepDecoder


@dataclass
class InputSpec:
    name: str
    example: torch.Tensor
    dims: dict[int, str]  # axis -> name of a range in DimRanges

    def signature(self, ranges: DimRanges) -> dict:
        shape = [self.dims.get(i, int(s)) for i, s in enumerate(self.example.shape)]
        return {"name": self.name, "dtype": str(self.example.dtype).removeprefix("torch."), "shape": shape}


def export_module(module: torch.nn.Module, inputs: list[InputSpec], ranges: DimRanges) -> ExportedProgram:
    """`torch.export` with positional example inputs, each axis dynamic over its named range."""
    bounds = ranges.to_dict()
    made: dict[str, Dim] = {}

    def dim(name: str) -> Dim:
        # torch.export refuses a Dim with min == max (max_batch 1): the graph is traced for one
        # more, and the manifest's limits (checked by the runtime) keep the declared range.
        if name not in made:
            lo, hi = bounds[name]
            made[name] = Dim(name, min=lo, max=max(hi, lo + 1))
        return made[name]

    shapes = tuple({axis: dim(n) for axis, n in i.dims.items()} or None for i in inputs)
    with torch.no_grad():
        return torch.export.export(module, tuple(i.example for i in inputs), dynamic_shapes=shapes, strict=False)


def capture(role: str, hf_model: torch.nn.Module, ranges: DimRanges) -> "StepGraph":
    """Wrap a Hugging Face causal LM as a step graph and trace it."""
    decoder = StepDecoder(hf_model).eval()
    weight = next(hf_model.parameters())
    dims = ModelDims.of(decoder, weight.dtype)
    examples = example_inputs(dims, weight.dtype, device=weight.device)
    inputs = [InputSpec(name, examples[name], dict(AXES[name])) for name in INPUT_NAMES]
    ep = export_module(decoder, inputs, ranges)
    graph = StepGraph.from_exported(role, ep, inputs, list(OUTPUT_NAMES), ranges, dims)
    graph.notes.append(decoder.capture_note())
    graph.head = {**norm_facts(decoder.norm), "hidden_size": hf_model.config.hidden_size, "family": decoder.family,
                  "logits_divisor": decoder.logits_divisor, "final_softcap": decoder.final_softcap}
    return graph


@dataclass
class StepGraph:
    """One graph of a bundle (target or draft) while it moves through the pass pipeline."""

    role: str
    gm: GraphModule
    inputs: list[InputSpec]
    outputs: list[str]
    ranges: DimRanges
    dims: ModelDims
    notes: list[str] = field(default_factory=list)  # what each pass did, for the manifest
    head: dict = field(default_factory=dict)  # final-norm and logit facts (norm kind, eps, offset, hidden size,
    # logits divisor, final soft-cap) for head-adding passes
    exported: ExportedProgram | None = field(default=None, repr=False)  # the capture, while no pass has edited gm
    vocab_ids: list[int] | None = None  # the token ids of the logits' columns, where a pass kept only some

    @classmethod
    def from_exported(cls, role: str, ep: ExportedProgram, inputs: list[InputSpec], outputs: list[str],
                      ranges: DimRanges, dims: ModelDims) -> "StepGraph":
        gm = ep.module()
        for node in list(gm.graph.nodes):
            if node.op == "call_module" and node.target == "_guards_fn":
                gm.graph.erase_node(node)
        gm.graph._codegen = torch.fx.graph.CodeGen()  # plain positional signature, editable
        gm._forward_pre_hooks.clear()  # the exported-input-spec check; passes change the inputs
        gm.recompile()
        # backends expect a tuple of outputs: a capture returning one bare tensor is traced again from gm
        as_is = ep if ep.call_spec.out_spec is not None and ep.call_spec.out_spec.type in (tuple, list) else None
        return cls(role, gm, inputs, outputs, ranges, dims, exported=as_is)

    # -- editing helpers used by passes -------------------------------------------------
    def placeholder(self, name: str) -> Node:
        for node in self.gm.graph.nodes:
            if node.op == "placeholder" and node.name == name:
                return node
        raise KeyError(f"{self.role} graph has no input {name!r}; inputs: {[i.name for i in self.inputs]}")

    def add_input(self, spec: InputSpec) -> Node:
        """Append a graph input after the existing ones."""
        last = [n for n in self.gm.graph.nodes if n.op == "placeholder"][-1]
        with self.gm.graph.inserting_after(last):
            node = self.gm.graph.placeholder(spec.name)
        node.meta["val"] = spec.example
        self.inputs.append(spec)
        self.exported = None
        return node

    def output_nodes(self) -> list[Node]:
        (out,) = self.gm.graph.find_nodes(op="output")
        return list(out.args[0])

    def module_output(self, path: str) -> Node:
        """The [B, T, hidden] value leaving the captured submodule at `path` (e.g. "layers.3")."""
        def inside(node: Node) -> bool:
            return any(p == path for p, _ in (node.meta.get("nn_module_stack") or {}).values())

        hidden = self.head.get("hidden_size")
        found = [n for n in self.gm.graph.nodes if inside(n) and any(not inside(u) for u in n.users)
                 and getattr(n.meta.get("val"), "dim", lambda: 0)() == 3 and n.meta["val"].shape[-1] == hidden]
        if len(found) != 1:
            raise KeyError(f"{self.role} graph: no unique hidden-state output of module {path!r} (found {len(found)})")
        return found[0]

    def set_outputs(self, names: list[str], nodes: list[Node]) -> None:
        (out,) = self.gm.graph.find_nodes(op="output")
        out.args = (tuple(nodes),)
        self.outputs = list(names)
        self.exported = None

    def finish_edit(self) -> None:
        """Remove dead nodes, lint the graph and regenerate code after a pass.

        Exported graphs are functional: besides inputs and outputs, a node without users
        (an unused layer, export's own assertions about dead values) is dead. Re-export
        emits the assertions that still apply.
        """
        self.gm.graph.eliminate_dead_code(is_impure_node=lambda n: n.op in ("placeholder", "output"))
        self.gm.graph.lint()
        self.gm.delete_all_unused_submodules()
        self.gm.recompile()
        self.exported = None

    # -- export -------------------------------------------------------------------------
    def export(self) -> ExportedProgram:
        """The program backends lower: the capture itself when no pass edited the graph, else gm traced again."""
        if self.exported is None:
            self.exported = export_module(self.gm, self.inputs, self.ranges)
        return self.exported

    def signature(self) -> dict:
        return {"inputs": [i.signature(self.ranges) for i in self.inputs], "outputs": list(self.outputs)}

    def summary(self) -> dict:
        """Op counts, inputs and outputs of the graph, for `--dump-graphs`."""
        ops: dict[str, int] = {}
        for node in self.gm.graph.nodes:
            if node.op == "call_function":
                key = str(node.target)
                ops[key] = ops.get(key, 0) + 1
        return {"role": self.role, **self.signature(), "op_counts": dict(sorted(ops.items())), "notes": self.notes}
