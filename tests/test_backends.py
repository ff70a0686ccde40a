"""Lowered engines agree with eager torch on random inputs across the dynamic shape ranges."""
from __future__ import annotations

import os
import zipfile

import onnx
import pytest
import torch
from transformers import AutoModelForCausalLM

from specc.backends import LowerOptions, get_backend
from specc.capture.shapes import dim_ranges, example_inputs
from specc.capture.graph import capture
from specc.errors import BackendUnavailableError
from specc.testing import make_tiny_model

SHAPES = [(1, 1, 0), (1, 5, 7), (3, 1, 64), (3, 4, 9)]  # batch, tokens, cache slots


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("m") / "qwen", arch="qwen2")
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    return capture("target", hf, dim_ranges(4, 128))


def _lowered(graph, backend_name, tmp_path, options=LowerOptions()):
    tmp_path.mkdir(parents=True, exist_ok=True)
    backend = get_backend(backend_name)
    entry = backend.lower(graph.export(), tmp_path, [i.name for i in graph.inputs], graph.outputs, options)
    entry.update(graph.signature())
    return backend.load(tmp_path, entry, options), entry


def _check(graph, runner, tol):
    for b, t, s in SHAPES:
        torch.manual_seed(b * 100 + t * 10 + s)
        ex = example_inputs(graph.dims, torch.float32, batch=b, tokens=t, cache=s)
        ex["cache_len"] = torch.randint(0, s + 1, (b,))
        args = [ex[i.name] for i in graph.inputs]
        with torch.no_grad():
            ref = graph.gm(*args)
        got = runner(*args)
        for r, g in zip(ref, got):
            assert r.shape == g.shape
            assert (r - g).abs().max().item() <= tol * max(1.0, r.abs().max().item()), (b, t, s)


# aoti compiles C++ (~15 s); test_lossless_aoti.py checks an AOTInductor bundle end to end in the default run
@pytest.mark.parametrize("backend", ["onnxruntime", "torch", pytest.param("aoti", marks=pytest.mark.heavy)])
def test_engine_matches_eager(graph, backend, tmp_path):
    runner, entry = _lowered(graph, backend, tmp_path)
    _check(graph, runner, 1e-4)
    if backend == "onnxruntime":
        model = onnx.load(str(tmp_path / entry["entry"]))
        onnx.checker.check_model(model)
        dims = [d.dim_param or d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
        assert all(isinstance(d, str) for d in dims), f"input_ids must be dynamic, got {dims}"
        assert entry["opset"] >= 23


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_draft_graph_is_close_and_smaller(graph, kind, tmp_path):
    full, full_entry = _lowered(graph, "onnxruntime", tmp_path / "fp32")
    quant, entry = _lowered(graph, "onnxruntime", tmp_path / kind, LowerOptions(quantize=kind))
    assert entry["entry"] == f"model.{kind}.onnx"
    size = lambda d: sum(p.stat().st_size for p in d.iterdir())
    assert size(tmp_path / kind) < 0.6 * size(tmp_path / "fp32")
    ex = example_inputs(graph.dims, torch.float32, batch=2, tokens=8, cache=4)
    args = [ex[i.name] for i in graph.inputs]
    a, b = full(*args)[0], quant(*args)[0]
    assert torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1] > 0.9  # lossy by design, but close


def test_torch_backend_writes_no_pickles(graph, tmp_path):
    """The torch backend stores JSON + safetensors (no zip, no pickle) and loads them back exactly."""
    runner, entry = _lowered(graph, "torch", tmp_path)
    assert sorted(entry["files"]) == ["program.json", "weights.safetensors"] and entry["entry"] == "program.json"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["program.json", "weights.safetensors"]
    assert not zipfile.is_zipfile(tmp_path / "program.json")
    _check(graph, runner, 1e-6)


def test_unknown_backend_is_named():
    with pytest.raises(BackendUnavailableError, match="unknown backend 'tf'.*onnxruntime"):
        get_backend("tf")


@pytest.mark.parametrize("spin", ["1", "0"])
def test_onnxruntime_pools_spin_only_inside_runs(spin, monkeypatch):
    """Each session's threads spin between operators (SPECC_ORT_SPIN=0: passive) and stop spinning when a
    run returns, so the draft's pool does not steal the cores from the target's, nor the reverse."""
    from specc.backends.onnxruntime_backend import session_options

    monkeypatch.setenv("SPECC_ORT_SPIN", spin)
    so = session_options()
    assert so.get_session_config_entry("session.intra_op.allow_spinning") == spin
    assert so.get_session_config_entry("session.force_spinning_stop") == "1"
    assert so.use_per_session_threads and so.intra_op_num_threads == len(os.sched_getaffinity(0))
