"""`specc triton`: write a Triton model repository from a bundle.

Layouts (docs/triton.md compares them):

    in-process   NAME/config.pbtxt, NAME/1/model.py, NAME/1/bundle/...      (every specc backend)
    split        NAME/          the orchestrator: manifest + tokenizer; calls the engines with BLS
                 NAME_target/   the target step graph (onnxruntime_onnx | tensorrt_plan | python)
                 NAME_draft/    the draft step graph, when the bundle has one

The repository is built in a hidden sibling directory and its model directories are moved
into place only when complete.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..version import __version__
from ..bundle import MANIFEST, Manifest, open_bundle
from ..errors import SpeccError
from .configs import PLATFORMS, _parameters, engine_config, orchestrator_config
from .pbtxt import to_pbtxt

LAYOUTS = ("in-process", "split")
ENGINES = ("native", "python")
VERSION = "1"
BUNDLE_DIR = "bundle"  # the bundle (or the part of it a model needs) inside a version directory
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")

_MODEL_PY = '''"""Triton python-backend model written by `specc triton` ({what}).

The code is specc's own (specc/triton/serving.py): the server's Python environment needs
the specc package installed, the same version that wrote this repository ({version}).
"""
from specc.triton.serving import {cls} as TritonPythonModel  # noqa: F401
'''


@dataclass
class ModelPlan:
    """One model directory of the repository."""

    name: str
    summary: str
    config: dict
    model_py: str | None = None  # the python backend's class, if a python-backend model
    files: list[tuple[Path, str]] = field(default_factory=list)  # (source, path under the version dir)


class RepositoryError(SpeccError):
    """The repository cannot be written as asked."""


def write_repository(bundle: str | Path, repo: str | Path, name: str | None = None, layout: str = "in-process",
                     engines: str = "native", force: bool = False, default_max_tokens: int = 64,
                     expect_id: str | None = None, trust_code: bool = False) -> list[ModelPlan]:
    """Write the Triton models that serve `bundle` into `repo`; returns what was written.

    engines (split layout): "native" serves the graphs with Triton's onnxruntime_onnx or
    tensorrt_plan platform; "python" with python-backend models running the bundle's backend.
    force: write into a non-empty repository, replacing model directories of the same names.
    The bundle's id goes into every model's parameters (`bundle_id`): the served models refuse
    a bundle whose id differs. trust_code: let the served models load backends that run code
    from the bundle (aoti, torch_tensorrt).
    """
    if layout not in LAYOUTS:
        raise RepositoryError(f"layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    if engines not in ENGINES:
        raise RepositoryError(f"engines {engines!r} is not one of {', '.join(ENGINES)}")
    if not (isinstance(default_max_tokens, int) and default_max_tokens >= 1):
        raise RepositoryError(f"default max_tokens must be an integer >= 1, got {default_max_tokens!r}")
    source = open_bundle(bundle, expect_id=expect_id)
    if trust_code is False:
        from ..backends import get_backend
        from ..bundle import check_code_trust

        check_code_trust(source, get_backend(source.manifest.backend, check=False).runs_bundle_code)
    name = name or _default_name(source.path)
    if not _NAME.fullmatch(name):
        raise RepositoryError(f"model name {name!r}: use letters, digits, '_', '.' and '-', starting with a letter or digit")
    repo = Path(repo)
    if repo.exists() and not repo.is_dir():
        raise RepositoryError(f"{repo} exists and is not a directory")
    if repo.exists() and any(repo.iterdir()) and not force:
        raise RepositoryError(f"{repo} exists and is not empty; pass --force to write into it "
                              "(model directories of the same names are replaced, other models are kept)")
    plans = _plan(source.path, source.manifest, name, layout, engines, default_max_tokens, trust_code)
    try:
        _write(repo, plans,
               header=f"written by specc {__version__} (`specc triton`, layout {layout}) from {source.path.resolve()}")
    except (OSError, ValueError) as exc:
        raise RepositoryError(f"cannot write the repository {repo}: {getattr(exc, 'strerror', None) or exc}") from None
    return plans


def _default_name(bundle: Path) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", bundle.resolve().name).lstrip("_.-") or "specc"


def _plan(bundle: Path, manifest: Manifest, name: str, layout: str, engines: str, default_max_tokens: int,
          trust_code: bool = False) -> list[ModelPlan]:
    recipe = manifest.recipe
    params = {"bundle": BUNDLE_DIR, "bundle_id": manifest.id, "trust_code": str(bool(trust_code)).lower(),
              "speculative": "true", "k": str(recipe.speculation.k), "default_max_tokens": str(default_max_tokens)}
    listed = lambda prefix="": [(bundle / rel, f"{BUNDLE_DIR}/{rel}") for rel in sorted(manifest.files) if rel.startswith(prefix)]
    if layout == "in-process":
        params["verify_bundle"] = "true"
        files = [(bundle / MANIFEST, f"{BUNDLE_DIR}/{MANIFEST}")] + listed()
        return [ModelPlan(name, f"speculative orchestrator + bundle ({manifest.backend} engines in the python backend)",
                          orchestrator_config(name, manifest, params), "InProcessModel", files)]

    roles = ["target"] + ([manifest.draft.graph] if manifest.draft.graph else [])
    engine_names = {role: f"{name}_{role}" for role in roles}
    params.update({f"{role}_model": engine_names[role] for role in roles})
    if engines == "native" and manifest.backend == "onnxruntime":  # ONNX engines that take their cache by layer
        params.update({f"{role}_cache_by_layer": str(manifest.graph(role).facts["cache_by_layer"])
                       for role in roles if manifest.graph(role).facts.get("cache_by_layer")})
    plans = [ModelPlan(name, f"speculative orchestrator; calls {', '.join(engine_names.values())} with BLS",
                       orchestrator_config(name, manifest, params), "SplitModel",
                       [(bundle / MANIFEST, f"{BUNDLE_DIR}/{MANIFEST}")] + listed(manifest.tokenizer.dir + "/"))]
    for role in roles:
        entry = manifest.graph(role)
        config = engine_config(engine_names[role], manifest, role, engines)
        graph_dir = bundle / entry.dir
        if engines == "native":
            files = [(graph_dir / f, f) for f in entry.files]
            plans.append(ModelPlan(engine_names[role],
                                   f"{role} step graph ({PLATFORMS[manifest.backend]}{_opset_note(entry.to_dict())})",
                                   config, None, files))
        else:
            config["parameters"] = config.get("parameters", []) + _parameters(
                {"bundle_id": manifest.id, "trust_code": params["trust_code"]})
            files = [(bundle / MANIFEST, f"{BUNDLE_DIR}/{MANIFEST}")] + listed(entry.dir + "/")
            plans.append(ModelPlan(engine_names[role], f"{role} step graph ({manifest.backend} in the python backend)",
                                   config, "EngineModel", files))
    return plans


def _opset_note(entry: dict) -> str:
    if "opset" not in entry:
        return ""
    ort = entry.get("versions", {}).get("onnxruntime", "?")
    return f", ONNX opset {entry['opset']}, built with onnxruntime {ort}: Triton's onnxruntime backend must run that opset"


def _write(repo: Path, plans: list[ModelPlan], header: str) -> None:
    repo = repo.resolve()
    repo.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{repo.name}.partial-", dir=repo.parent))
    try:
        for plan in plans:
            root = stage / plan.name
            version = root / VERSION
            version.mkdir(parents=True)
            (root / "config.pbtxt").write_text(to_pbtxt(plan.config, header=header))
            if plan.model_py:
                (version / "model.py").write_text(_MODEL_PY.format(what=plan.summary, version=__version__, cls=plan.model_py))
            for src, rel in plan.files:
                dst = version / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                _link_or_copy(src, dst)
        repo.mkdir(exist_ok=True)
        for plan in plans:
            target = repo / plan.name
            if target.exists():
                shutil.rmtree(target)
            (stage / plan.name).rename(target)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link bundle files (bundles are replaced by rename, never edited in place); copy across devices."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
