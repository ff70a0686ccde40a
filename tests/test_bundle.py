"""Bundles verify by hash and version, and say exactly what is wrong."""
from __future__ import annotations

import json
import shutil

import pytest

import specc
from specc.bundle import open_bundle
from specc.errors import BundleError


@pytest.fixture
def copy(bundles, tmp_path):
    dst = tmp_path / "b"
    shutil.copytree(bundles["draft"], dst)
    return dst


def test_manifest_describes_everything(bundles):
    m = open_bundle(bundles["draft"]).manifest.raw
    assert m["format"] == "specc-bundle" and m["format_version"] == 2
    for key in ("specc", "torch", "onnxruntime", "onnx"):
        assert key in m["versions"]
    for role in ("target", "draft"):
        g = m["graphs"][role]
        assert [i["name"] for i in g["inputs"]] == ["input_ids", "position_ids", "cache_len", "logit_index", "k_cache", "v_cache"]
        assert g["inputs"][0]["shape"] == ["batch", "tokens"]
        assert g["ranges"]["batch"] == [1, 4] and g["ranges"]["cache"] == [1, 256]
        assert g["numerics"]["max_rel_diff"] < 1e-4
        for f in g["files"]:
            assert f"{g['dir']}/{f}" in m["files"]
    assert "tokenizer/tokenizer.json" in m["files"]
    assert all(len(v["sha256"]) == 64 for v in m["files"].values())


def test_tampered_file_is_named(copy):
    data = copy / "target" / "model.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(BundleError, match=r"target/model.onnx.data: sha256 differs"):
        specc.load(copy)


def test_truncated_file_is_named(copy):
    data = copy / "draft" / "model.onnx.data"
    data.write_bytes(data.read_bytes()[:1000])
    with pytest.raises(BundleError, match=r"draft/model.onnx.data: 1000 bytes, manifest says \d+ \(truncated"):
        specc.load(copy)


def test_missing_file_is_named(copy):
    (copy / "tokenizer" / "tokenizer.json").unlink()
    with pytest.raises(BundleError, match="tokenizer/tokenizer.json: missing"):
        specc.load(copy)


def test_other_format_version_is_refused(copy):
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["format_version"] = 99
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="format version 99 is not supported.*reads version 2"):
        specc.load(copy)


def test_corrupt_or_missing_manifest(copy, tmp_path):
    (copy / "manifest.json").write_text("{not json")
    with pytest.raises(BundleError, match="not valid JSON"):
        specc.load(copy)
    with pytest.raises(BundleError, match="does not exist"):
        specc.load(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(BundleError, match="no manifest.json"):
        specc.load(tmp_path / "empty")


def test_backend_version_mismatch_is_named(copy, monkeypatch):
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["versions"]["onnxruntime"] = "99.0.0"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match=r"onnxruntime 99.0.0.*this machine has onnxruntime \d"):
        specc.load(copy)


def test_failed_compile_keeps_previous_bundle(bundles, models_dir, tmp_path):
    from conftest import build_bundle

    out = tmp_path / "out"
    shutil.copytree(bundles["draft"], out)
    before = (out / "manifest.json").read_text()
    with pytest.raises(Exception):
        build_bundle(out, models_dir / "missing-model", {"method": "none"})
    assert (out / "manifest.json").read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"], "no partial directories left behind"
