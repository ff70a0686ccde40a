"""Shared fixtures: tiny random models and bundles built once per test run in temp dirs (once for all xdist workers)."""
from __future__ import annotations

import fcntl
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from specc.compiler import compile_recipe
from specc.recipe import parse_recipe
from specc.testing import derive_draft, make_tiny_model


def pytest_configure(config) -> None:
    """Under pytest-xdist (`make test` runs one worker per core), pin each worker to its own core: ONNX
    Runtime and torch size their thread pools by the cores they may use, and two workers whose pools
    share both cores run slower together than one worker alone."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker or count < 2 or not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    if count > len(cpus):
        return
    per = len(cpus) // count
    index = int(worker.removeprefix("gw"))
    os.sched_setaffinity(0, cpus[index * per:(index + 1) * per])
    os.environ["OMP_NUM_THREADS"] = str(per)  # subprocesses (the CLI, servers) inherit both
    import torch

    torch.set_num_threads(per)


def built_once(tmp_path_factory, name: str, build: Callable[[Path], object]) -> Path:
    """`build(path)` run once per test run; `name` is a relative path whose last part names what tests see
    (bench tables name a bundle by its directory). xdist workers share the run's temp root, and a worker
    that finds another building waits for it (a file lock). What it builds must be read only to the tests."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "built-once"
    root.mkdir(exist_ok=True)
    path, done = root / name, root / f"{name}.done"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(path, ignore_errors=True)
            build(path)
            done.touch()
    return path


def _tiny_models(root: Path) -> None:
    make_tiny_model(root / "target", seed=0, layers=3)
    derive_draft(root / "target", root / "draft", layers=2)
    derive_draft(root / "target", root / "wrong", shift_lm_head=1)


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    """target: 3-layer llama; draft: its first 2 layers (partial acceptance);
    wrong: the target with its LM head rolled by one row, so its greedy token is never the target's."""
    return built_once(tmp_path_factory, "models", _tiny_models)


def build_bundle(out: Path, target: Path, draft: dict, backend: str = "onnxruntime", **extra) -> Path:
    recipe = parse_recipe({
        "target": {"model": str(target)},
        "draft": draft,
        "speculation": extra.pop("speculation", {"k": 3}),
        "limits": extra.pop("limits", {"max_batch": 4, "max_context": 256}),
        "backend": backend,
        **extra,
    })
    return compile_recipe(recipe, output=out, progress=False)


class LazyBundles(dict):
    """Bundles built on first use (a test run that needs two of them builds two), once for all workers."""

    def __init__(self, tmp_path_factory, recipes: dict[str, tuple]):
        super().__init__()
        self.factory, self.recipes = tmp_path_factory, recipes

    def __missing__(self, name: str) -> Path:
        target, draft, extra = self.recipes[name]
        self[name] = built_once(self.factory, f"bundles/{name}", lambda out: build_bundle(out, target, draft, **extra))
        return self[name]


def small_chain_bundle(root: Path, vocab: int) -> tuple[Path, Path]:
    """A tiny target of `vocab` tokens with sharp logits, and a chain bundle drafted by a one-layer perturbed copy
    of it: the small enough model the sampled-distribution checks enumerate."""
    from specc.testing import derive_draft, make_tiny_model

    target = make_tiny_model(root / "target", seed=0, vocab_size=vocab, logit_scale=2.0)
    draft = derive_draft(target, root / "draft", layers=1, perturb=0.05)
    bundle = build_bundle(root / "chain", target, {"method": "model", "model": str(draft)},
                          limits={"max_batch": 512, "max_context": 64}, speculation={"k": 2})
    return target, bundle


@pytest.fixture(scope="session")
def bundles(models_dir, tmp_path_factory) -> dict[str, Path]:
    """Bundles keyed by draft: 'draft' (ORT), 'self' (draft = target), 'wrong' (always rejected);
    'tree_*' the same drafts with tree speculation (dynamic top-k, or static paths); early exit
    (chain and tree), prompt lookup, and prompt lookup in front of the draft model ('lookup_first');
    'long_lookup': prompt lookup with a 4096-token context (long prompts against a live server); lookahead
    decoding ('lookahead', and 'lookahead_torch' with another window); 'wrong' runs on the torch backend."""
    t = models_dir / "target"
    draft = {"method": "model", "model": str(models_dir / "draft")}
    wrong = {"method": "model", "model": str(models_dir / "wrong")}
    itself = {"method": "model", "model": str(t)}
    dynamic = {"mode": "tree", "tree": {"depth": 3, "branching": 2, "max_nodes": 8}}
    static = {"mode": "tree", "tree": {"paths": [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]}}
    chain_paths = {"mode": "tree", "tree": {"paths": [[0], [0, 0], [0, 0, 0]]}}
    return LazyBundles(tmp_path_factory, {
        "draft": (t, draft, {}),
        "self": (t, itself, {}),
        "wrong": (t, wrong, {"backend": "torch"}),
        "tree_dynamic": (t, draft, {"speculation": dynamic}),
        "tree_static": (t, draft, {"speculation": static}),
        "tree_self": (t, itself, {"speculation": static}),
        "tree_wrong": (t, wrong, {"speculation": chain_paths}),
        "early_exit": (t, {"method": "early_exit", "layer": 2}, {}),
        "early_exit_tree": (t, {"method": "early_exit", "layer": 1}, {"speculation": dynamic}),
        "prompt_lookup": (t, {"method": "prompt_lookup", "max_ngram": 2}, {}),
        "lookup_first": (t, {**draft, "lookup": True, "min_ngram": 2}, {}),
        "verify_head": (t, draft, {"speculation": {"k": 3, "verify_head": True}}),
        "long_lookup": (t, {"method": "prompt_lookup", "max_ngram": 2}, {"limits": {"max_batch": 4, "max_context": 4096}}),
        "lookahead": (t, {"method": "lookahead"}, {"speculation": {"mode": "tree"}}),
        "lookahead_torch": (t, {"method": "lookahead", "window": 3, "ngram": 4, "verify_ngrams": 2},
                            {"speculation": {"mode": "tree"}, "backend": "torch"}),
    })


@pytest.fixture(scope="session")
def prompts() -> list[str]:
    """60 prompts of 1 to 40 characters (tokens, for the byte tokenizer); every third repeats
    itself, so n-gram lookup finds drafts."""
    rng = random.Random(1234)
    alphabet = "abcdefghijklmnopqrstuvwxyz  ,.()=:\n"
    out = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(60)]
    return [p * 3 if i % 3 == 0 else p for i, p in enumerate(out)]


@pytest.fixture
def whole_draft_context(monkeypatch):
    """A draft model's cache takes in every test prompt whole (no sink and window): for tests whose draft is the
    target itself and so must have every draft accepted."""
    from specc.runtime.drafters import model as model_drafter

    monkeypatch.setattr(model_drafter, "DRAFT_WINDOW_MIN", model_drafter.DRAFT_WINDOW)
