"""specc's layers import one way only: every import (module level or inside a function: a lazy import is
still a dependency) points to the same layer or a lower one, no group of modules imports itself in a
circle (not even through imports for type hints only), the applications on top import none of each other,
the scheduler and planner see the runtime's Engine and never the model API above it, and no module grows
past MAX_LINES."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "specc"

APPLICATIONS = ("specc.serving", "specc.bench", "specc.triton", "specc.training", "specc.testing")

# bottom first: a module may import from its own layer and the layers above it in this list
LAYERS: list[tuple[str, ...]] = [
    ("specc.version", "specc.errors", "specc.limits", "specc.digest", "specc.progress", "specc.block_weights",
     "specc.prompts"),
    ("specc.kernels",),  # specc's own CPU kernels, which the ONNX passes emit and the ONNX Runtime backend registers
    ("specc.speculation",),
    ("specc.methods", "specc.recipe", "specc.recipe_edit"),
    ("specc.models", "specc.capture", "specc.heads"),
    ("specc.passes",),
    ("specc.onnx_passes",),
    ("specc.hardware",),  # asks this CPU's kernels what the ONNX passes emit
    ("specc.backends",),
    ("specc.bundle",),
    ("specc.compiler",),
    ("specc.runtime",),
    APPLICATIONS,
    ("specc.cli",),
    ("specc",),  # the package itself: the public `specc.load`
]


MAX_LINES = 500  # a module past this does more than one job: split it


def layer_of(module: str) -> int:
    best = None
    for rank, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[1]):
                best = (rank, len(p))
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best[0]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(node: ast.AST, parents: dict) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def imports_of(path: Path, me: str | None = None, type_hints: bool = False) -> set[str]:
    """specc modules imported by a file (relative imports resolved; TYPE_CHECKING blocks skipped unless
    `type_hints`)."""
    me = me or module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = set()
    for node in ast.walk(tree):
        if not type_hints and _type_checking_only(node, parents):
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "specc"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "specc":
                continue
            for alias in node.names:  # `from . import x` may name a submodule
                sub = f"{target}.{alias.name}"
                found.add(sub if (ROOT.parent / sub.replace(".", "/")).with_suffix(".py").exists()
                          or (ROOT.parent / sub.replace(".", "/")).is_dir() else target)
    found.discard(me)
    return found


GRAPH = {module_name(p): imports_of(p) for p in sorted(ROOT.rglob("*.py"))}
WITH_TYPE_HINTS = {module_name(p): imports_of(p, type_hints=True) for p in sorted(ROOT.rglob("*.py"))}

# what runs rounds sees the Engine (runtime/engine.py) only, never the request-facing model API on top of it
ROUND_RUNNERS = ("specc.runtime.scheduler", "specc.runtime.planning", "specc.runtime.rounds")
MODEL_API = ("specc.runtime.model",)


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module `start` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for n in graph.get(todo.pop(), ()):
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return seen


def test_every_module_has_a_layer():
    for module in GRAPH:
        layer_of(module)


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_point_down(module):
    upward = sorted(m for m in GRAPH[module] if layer_of(m) > layer_of(module))
    assert not upward, f"{module} (layer {LAYERS[layer_of(module)]}) imports upward: {upward}"


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_applications_import_none_of_each_other(module):
    """serving, bench, triton, training and testing share a layer but not code: what two of them need lives below."""
    mine = next((a for a in APPLICATIONS if module == a or module.startswith(a + ".")), None)
    sideways = sorted(m for m in GRAPH[module] for a in APPLICATIONS
                      if mine and a != mine and (m == a or m.startswith(a + ".")))
    assert not sideways, f"{module} imports another application: {sideways}"


@pytest.mark.parametrize("path", sorted(ROOT.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_no_module_over_max_lines(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT.parent)} has {lines} lines, above {MAX_LINES}: split it by job"


@pytest.mark.parametrize("graph", [GRAPH, WITH_TYPE_HINTS], ids=["imports", "with type hints"])
def test_no_import_cycles(graph):
    """No module reaches itself through imports (package __init__ files count as their modules), nor through
    imports for type hints only: a circle hidden under TYPE_CHECKING is coupling all the same."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if n not in graph:
                continue
            if state.get(n) == 1:
                cycle = stack[stack.index(n):] + [n]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


@pytest.mark.parametrize("module", ROUND_RUNNERS)
def test_what_runs_rounds_imports_no_model_api(module):
    """The scheduler, the planner and the rounds import the Engine, not the model API (even for type hints)."""
    found = sorted(m for m in reachable(WITH_TYPE_HINTS, module) if m in MODEL_API)
    assert not found, f"{module} imports the model API: {found}"
    assert "specc.runtime.engine" in reachable(WITH_TYPE_HINTS, "specc.runtime.scheduler")


def test_the_checker_sees_upward_imports_and_cycles(tmp_path):
    """An upward import inside a function (counted) and one under TYPE_CHECKING (allowed: types only)."""
    probe = tmp_path / "probe.py"
    probe.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..bench import run\n"
                     "def f():\n    from ..runtime.model import SpecModel\n"
                     "class C:\n    def g(self):\n        try:\n            import specc.serving.app\n"
                     "        except ImportError:\n            pass\n")
    found = imports_of(probe, "specc.passes.probe")
    assert found == {"specc.runtime.model", "specc.serving.app"}
    assert all(layer_of(m) > layer_of("specc.passes.probe") for m in found)
