"""Hostile and careless input: tampered bundles, code-executing formats, fuzzed recipes, requests and
manifests. Every bad input is one `specc: error:` (exit 2) or one SpeccError, never a traceback or a
hang; a bundle that loads is exactly the bytes its id pins. docs/security.md states the trust model."""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import specc
from specc.bundle import MANIFEST, Manifest, bundle_id, open_bundle, read_manifest
from specc.cli import main
from specc.digest import sha256_of
from specc.errors import BundleError, RequestError, SpeccError

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
# `pytest -m heavy tests/test_hostile.py` runs the big fuzz (kept out of the default run and CI); SPECC_FUZZ_EXAMPLES sets its size per test.
FUZZ_SLOW = settings(max_examples=int(os.environ.get("SPECC_FUZZ_EXAMPLES", "500")), deadline=None,
                     suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def small(models_dir, tmp_path_factory) -> dict[str, Path]:
    """Two one-graph bundles: onnxruntime with prompt lookup, torch without a draft."""
    from conftest import build_bundle

    root = tmp_path_factory.mktemp("hostile")
    limits = {"max_batch": 2, "max_context": 64}
    t = models_dir / "target"
    return {"ort": build_bundle(root / "ort", t, {"method": "prompt_lookup"}, limits=limits),
            "torch": build_bundle(root / "torch", t, {"method": "none"}, backend="torch", limits=limits)}


@pytest.fixture(scope="module")
def model(small):
    return specc.load(small["ort"])


def copy_of(bundle: Path, tmp_path: Path, name: str = "b") -> Path:
    return Path(shutil.copytree(bundle, tmp_path / name))


def raw(bundle: Path) -> dict:
    return json.loads((bundle / MANIFEST).read_text())


def write(bundle: Path, manifest: dict | str) -> None:
    text = manifest if isinstance(manifest, str) else json.dumps(manifest)
    (bundle / MANIFEST).write_text(text)


def rehash(manifest: dict, bundle: Path, rel: str) -> None:
    """What an attacker with write access does: record the new file's size and sha256."""
    manifest["files"][rel] = {"sha256": sha256_of(bundle / rel), "bytes": (bundle / rel).stat().st_size}


def run_cli(args: list[str], capsys) -> tuple[int, str]:
    """main() in this process; any exception escaping it is a traceback the user would see."""
    rc = main([str(a) for a in args])
    return rc, capsys.readouterr().err


def assert_one_error(rc: int, err: str, match: str | None = None) -> None:
    assert rc == 2, err
    assert err.count("specc: error: ") == 1 and "Traceback" not in err, err  # (progress bars may come before it)
    if match:
        assert match in err, err


# -- the bundle id -------------------------------------------------------------------------------
def test_id_is_the_canonical_manifest_hash_and_is_shown(small, capsys):
    manifest = read_manifest(small["ort"])
    data = raw(small["ort"])
    assert manifest.id == bundle_id(data) and manifest.id.startswith("sha256:") and len(manifest.id) == 71
    assert main(["inspect", str(small["ort"])]) == 0
    assert manifest.id in capsys.readouterr().out
    rc = main(["generate", str(small["ort"]), "--prompt", "ab", "--max-new-tokens", "2", "--json"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["bundle_id"] == manifest.id
    write_pretty = json.dumps(data, indent=7, sort_keys=True)  # layout and key order are not part of the id
    assert Manifest.from_dict(json.loads(write_pretty)).id == manifest.id


def _leaves(obj, path=()):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, path + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _leaves(v, path + (i,))
    else:
        yield path, obj


def _set(obj, path, value):
    for key in path[:-1]:
        obj = obj[key]
    obj[path[-1]] = value


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False)
                           | st.text(max_size=20), lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
                           max_leaves=6)


@FUZZ
@given(data=st.data())
def test_any_manifest_change_changes_the_id(small, data):
    base = raw(small["ort"])
    leaves = list(_leaves(base))
    path, old = data.draw(st.sampled_from(leaves))
    new = data.draw(JSON_VALUES.filter(lambda v: not (v == old and type(v) is type(old))))
    changed = json.loads(json.dumps(base))
    _set(changed, path, new)
    assert bundle_id(changed) != bundle_id(base)


def test_expect_id_pins_the_bundle(small, tmp_path, capsys):
    good = read_manifest(small["ort"]).id
    assert specc.load(small["ort"], expect_id=good).bundle.id == good
    assert specc.load(small["ort"], expect_id=good.removeprefix("sha256:").upper()).bundle.id == good
    with pytest.raises(BundleError, match="has id sha256:.*not the expected sha256:0000"):
        specc.load(small["ort"], expect_id="sha256:" + "0" * 64)
    with pytest.raises(BundleError, match="is not 'sha256:' followed by 64 hex digits"):
        specc.load(small["ort"], expect_id="sha256:abc")
    assert_one_error(*run_cli(["generate", small["ort"], "--prompt", "x", "--expect-id", "f" * 64], capsys), "not the expected")
    assert_one_error(*run_cli(["inspect", small["ort"], "--expect-id", "nope"], capsys), "64 hex digits")

    # What pinning means: a rewritten file with its hash rewritten too is a valid bundle, with another id.
    b = copy_of(small["ort"], tmp_path)
    m = raw(b)
    (b / "tokenizer" / "tokenizer_config.json").write_text("{}")
    rehash(m, b, "tokenizer/tokenizer_config.json")
    write(b, m)
    assert open_bundle(b).id != good
    with pytest.raises(BundleError, match="not the expected"):
        specc.load(b, expect_id=good)


# -- tampering ------------------------------------------------------------------------------------
def _outside(tmp_path: Path) -> Path:
    secret = tmp_path / "secret.txt"
    secret.write_text("not yours")
    return secret


def t_absolute_path(b, m, tmp):
    secret = _outside(tmp)
    m["files"][str(secret)] = {"sha256": sha256_of(secret), "bytes": secret.stat().st_size}


def t_dotdot_path(b, m, tmp):
    secret = _outside(tmp)
    rel = os.path.relpath(secret, b)
    m["files"][rel] = {"sha256": sha256_of(secret), "bytes": secret.stat().st_size}


def t_graph_dir_outside(b, m, tmp):
    m["graphs"]["target"]["dir"] = ".."


def t_graph_dir_absolute(b, m, tmp):
    m["graphs"]["target"]["dir"] = str(tmp)


def t_graph_dir_unlisted(b, m, tmp):
    (b / "evil").mkdir()
    shutil.copy(b / "target" / "model.onnx", b / "evil" / "model.onnx")
    m["graphs"]["target"]["dir"] = "evil"


def t_graph_file_not_in_table(b, m, tmp):
    m["graphs"]["target"]["files"].append("plugin.so")
    (b / "target" / "plugin.so").write_bytes(b"\x7fELF")


def t_unlisted_file_in_graph_dir(b, m, tmp):
    (b / "target" / "extra.onnx.data").write_bytes(b"\0" * 64)


def t_unlisted_file_in_tokenizer(b, m, tmp):
    (b / "tokenizer" / "special_tokens_map.json").write_text("{}")


def t_listed_but_not_a_graph_file(b, m, tmp):
    (b / "target" / "extra.bin").write_bytes(b"x")
    rehash(m, b, "target/extra.bin")


def t_symlink_out(b, m, tmp):
    secret = _outside(tmp)
    shutil.copy(b / "tokenizer" / "tokenizer.json", secret)
    (b / "tokenizer" / "tokenizer.json").unlink()
    (b / "tokenizer" / "tokenizer.json").symlink_to(secret)


def t_symlinked_dir(b, m, tmp):
    shutil.copytree(b / "tokenizer", tmp / "tok")
    shutil.rmtree(b / "tokenizer")
    (b / "tokenizer").symlink_to(tmp / "tok", target_is_directory=True)


def t_fifo(b, m, tmp):
    os.mkfifo(b / "target" / "pipe")
    m["files"]["target/pipe"] = {"sha256": "0" * 64, "bytes": 0}
    m["graphs"]["target"]["files"].append("pipe")


def t_manifest_symlink(b, m, tmp):
    (tmp / "m.json").write_text(json.dumps(m))
    return "symlink"


def t_modified_file(b, m, tmp):
    data = bytearray((b / "target" / "model.onnx").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (b / "target" / "model.onnx").write_bytes(bytes(data))


def t_onnx_external_data_outside(b, m, tmp):
    import onnx

    shutil.copy(b / "target" / "model.onnx.data", tmp / "outside.data")
    graph = onnx.load(str(b / "target" / "model.onnx"), load_external_data=False)
    for tensor in graph.graph.initializer:
        for e in tensor.external_data:
            if e.key == "location":
                e.value = "../../outside.data"
    onnx.save(graph, str(b / "target" / "model.onnx"))
    rehash(m, b, "target/model.onnx")


def t_backend_switched(b, m, tmp):
    m["backend"] = "torch"


def t_backend_switched_both(b, m, tmp):
    m["backend"] = m["recipe"]["backend"] = "torch"


def t_backend_switched_to_aoti(b, m, tmp):
    m["backend"] = m["recipe"]["backend"] = "aoti"


def t_files_as_list(b, m, tmp):
    m["files"] = list(m["files"])


def t_entry_without_bytes(b, m, tmp):
    del m["files"]["tokenizer/tokenizer.json"]["bytes"]


def t_bytes_as_bool(b, m, tmp):
    m["files"]["tokenizer/tokenizer.json"]["bytes"] = True


def t_models_missing(b, m, tmp):
    del m["models"]


def t_max_batch_zero(b, m, tmp):
    m["recipe"]["limits"]["max_batch"] = 0


def t_eos_not_a_list(b, m, tmp):
    m["tokenizer"]["eos_token_ids"] = 256


def t_eos_bools(b, m, tmp):
    m["tokenizer"]["eos_token_ids"] = [True]


def t_eos_outside_vocab(b, m, tmp):
    m["tokenizer"]["eos_token_ids"] = [2**40]


def t_format_version_string(b, m, tmp):
    m["format_version"] = "2"


def t_unknown_top_level(b, m, tmp):
    m["loader"] = "pickle"


def t_sha_not_hex(b, m, tmp):
    m["files"]["tokenizer/tokenizer.json"]["sha256"] = "Z" * 64


def t_inputs_shape_bad(b, m, tmp):
    m["graphs"]["target"]["inputs"][0]["shape"] = [-1, None]


def t_entry_not_in_files(b, m, tmp):
    m["graphs"]["target"]["entry"] = "../../x.onnx"


def t_tokenizer_dir_outside(b, m, tmp):
    m["tokenizer"]["dir"] = "../tokenizer"


def t_duplicate_key(b, m, tmp):
    text = json.dumps(m)
    return text.replace('"backend": "onnxruntime"', '"backend": "torch", "backend": "onnxruntime"', 1)


def t_nan(b, m, tmp):
    return json.dumps(m).replace('"temperature": 0.0', '"temperature": NaN', 1)


def t_deep_nesting(b, m, tmp):
    return json.dumps(m)[:-1] + ', "compile_seconds": ' + "[" * 100_000 + "]" * 100_000 + "}"


def t_not_an_object(b, m, tmp):
    return "[1, 2, 3]"


def t_not_utf8(b, m, tmp):
    (b / MANIFEST).write_bytes(b"\xff\xfe" + json.dumps(m).encode("utf-16-le"))
    return "raw"


TAMPERS = {
    t_absolute_path: "not a plain relative path",
    t_dotdot_path: "not a plain relative path",
    t_graph_dir_outside: "graphs.target.dir",
    t_graph_dir_absolute: "graphs.target.dir",
    t_graph_dir_unlisted: "not in the manifest's file table",
    t_graph_file_not_in_table: "graphs.target.files",
    t_unlisted_file_in_graph_dir: "target/extra.onnx.data: present but not listed",
    t_unlisted_file_in_tokenizer: "tokenizer/special_tokens_map.json: present but not listed",
    t_listed_but_not_a_graph_file: "lies in the graph directory but is not one of the graph's files",
    t_symlink_out: "tokenizer/tokenizer.json: a symlink",
    t_symlinked_dir: "tokenizer: a symlink",
    t_fifo: "target/pipe: not a regular file",
    t_manifest_symlink: "not a regular file",
    t_modified_file: "target/model.onnx: sha256 differs",
    t_onnx_external_data_outside: "reads external data from ['../../outside.data']",
    t_backend_switched: "differs from recipe.backend",
    t_backend_switched_both: "specc loads no .pt2 archives" ,
    t_backend_switched_to_aoti: "trust_code=True",
    t_files_as_list: "manifest field 'files': expected an object",
    t_entry_without_bytes: "manifest field 'files.tokenizer/tokenizer.json.bytes': missing",
    t_bytes_as_bool: "files.tokenizer/tokenizer.json.bytes': expected an integer",
    t_models_missing: "manifest field 'models': missing",
    t_max_batch_zero: "manifest field 'recipe.limits.max_batch': 0 is below the minimum 1",
    t_eos_not_a_list: "tokenizer.eos_token_ids': expected a list",
    t_eos_bools: "tokenizer.eos_token_ids': expected a list of token ids",
    t_eos_outside_vocab: "outside the vocabulary",
    t_format_version_string: "format version '2' is not supported",
    t_unknown_top_level: "manifest field 'loader': unknown field",
    t_sha_not_hex: "64 lowercase hex digits",
    t_inputs_shape_bad: "graphs.target.inputs[0].shape",
    t_entry_not_in_files: "graphs.target.entry",
    t_tokenizer_dir_outside: "tokenizer.dir",
    t_duplicate_key: "'backend' twice",
    t_nan: "NaN",
    t_deep_nesting: "manifest",
    t_not_an_object: "expected a JSON object",
    t_not_utf8: "not valid JSON",
}


@pytest.mark.parametrize("tamper", list(TAMPERS), ids=lambda f: f.__name__[2:])
def test_tampered_bundle_is_refused_by_name(small, tmp_path, capsys, tamper):
    b = copy_of(small["ort"], tmp_path)
    m = raw(b)
    out = tamper(b, m, tmp_path)
    if out == "symlink":
        (b / MANIFEST).unlink()
        (b / MANIFEST).symlink_to(tmp_path / "m.json")
    elif out != "raw":
        write(b, out if isinstance(out, str) else m)
    with pytest.raises(BundleError) as info:
        specc.load(b)
    assert TAMPERS[tamper] in str(info.value)
    assert_one_error(*run_cli(["generate", b, "--prompt", "x", "--max-new-tokens", "1"], capsys))
    if tamper not in (t_backend_switched_both, t_backend_switched_to_aoti, t_onnx_external_data_outside):  # inspect opens no engine
        assert_one_error(*run_cli(["inspect", b], capsys))


def test_no_verify_still_checks_sizes_listing_and_loaders(small, tmp_path):
    b = copy_of(small["ort"], tmp_path)
    onnx = b / "target" / "model.onnx"
    data = onnx.read_bytes()
    onnx.write_bytes(data[: len(data) // 2])
    with pytest.raises(BundleError, match=r"target/model.onnx: \d+ bytes, manifest says \d+ \(truncated"):
        specc.load(b, verify=False)
    onnx.write_bytes(b"\0" * len(data))  # same size, garbage: only the hash would see it; the loader fails cleanly
    with pytest.raises(BundleError, match="model.onnx is not a readable ONNX graph"):
        specc.load(b, verify=False)
    t = copy_of(small["torch"], tmp_path, "t")
    program = t / "target" / "program.json"
    program.write_bytes(b"[" * program.stat().st_size)
    with pytest.raises(BundleError, match="program.json is not valid JSON"):
        specc.load(t, verify=False)


# -- code execution -----------------------------------------------------------------------------------
class _Payload:
    """Unpickling this creates the marker file: the proof that loading ran code."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _malicious_pt2(tmp_path: Path, marker: Path) -> Path:
    """A genuine torch.export archive whose sample inputs are a pickle that creates `marker`."""
    import io
    import zipfile

    import torch

    class Tiny(torch.nn.Module):
        def forward(self, x):
            return x + 1

    good = tmp_path / "good.pt2"
    torch.export.save(torch.export.export(Tiny(), (torch.ones(2),)), good)
    bad = tmp_path / "graph.pt2"
    payload = io.BytesIO()
    torch.save(_Payload(marker), payload)
    with zipfile.ZipFile(good) as zin, zipfile.ZipFile(bad, "w") as zout:
        for item in zin.namelist():
            zout.writestr(item, payload.getvalue() if "sample_inputs" in item else zin.read(item))
    return bad


def test_pickle_proof_of_concept_is_real_and_never_runs(small, tmp_path):
    import torch

    marker = tmp_path / "pwned"
    evil = _malicious_pt2(tmp_path, marker)
    with pytest.raises(Exception):  # the archive is genuine: torch.export.load runs the payload
        torch.export.load(evil)
    assert marker.exists(), "the proof of concept must execute under torch.export.load"
    marker.unlink()

    for backend in ("torch", "aoti", "torch_tensorrt"):
        b = copy_of(small["torch"], tmp_path, backend)
        m = raw(b)
        for name in ("program.json", "weights.safetensors"):
            (b / "target" / name).unlink()
            del m["files"][f"target/{name}"]
        shutil.copy(evil, b / "target" / "graph.pt2")
        m["graphs"]["target"].update(entry="graph.pt2", files=["graph.pt2"])
        m["backend"] = m["recipe"]["backend"] = backend
        if backend == "torch_tensorrt":
            m["recipe"]["device"] = "cuda"
        rehash(m, b, "target/graph.pt2")
        write(b, m)  # a consistent manifest: hashes alone cannot catch this bundle
        with pytest.raises(SpeccError, match="no .pt2 archives|trust_code=True|needs device|not available"):
            specc.load(b)
        assert not marker.exists(), f"{backend}: loading ran code from the bundle"


@pytest.mark.parametrize("edit, match", [
    (lambda d: d["graph_module"]["graph"]["nodes"][0].update(target="builtins.eval"), "calls 'builtins.eval'"),
    (lambda d: d["graph_module"]["graph"]["nodes"][0].update(target="torch.load"), "calls 'torch.load'"),
    (lambda d: d["graph_module"]["graph"]["nodes"][0].update(target="torch.ops.aten.from_file.default"), "from_file"),
    (lambda d: d["graph_module"]["graph"]["nodes"][0].update(target="#custom_op"), "calls '#custom_op'"),
    (lambda d: d.update(guards_code=["__import__('os').system('x')"]), "guards_code"),
    (lambda d: d["graph_module"]["graph"].setdefault("sym_int_values", {}).update(
        s={"as_expr": {"expr_str": "__import__('os').system('x')", "hint": None}}), "not sympy arithmetic"),
])
def test_torch_program_runs_only_aten_operators(small, tmp_path, edit, match):
    from specc.backends.torch_program import check_program

    data = json.loads((small["torch"] / "target" / "program.json").read_text())
    check_program(data, "program.json")  # the compiled program passes
    edit(data)
    with pytest.raises(BundleError, match=match):
        check_program(data, "program.json")


# -- tracebacks, hangs and silent acceptance --------------------------------------------------------
BAD_REQUESTS = [
    (dict(temperature=float("nan")), "temperature must be a number"),
    (dict(temperature=float("inf")), "temperature must be a number"),
    (dict(temperature=True), "temperature must be a number"),
    (dict(temperature=b"1"), "temperature must be a number"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(top_k=10**30), "top_k must be an integer"),
    (dict(top_k=True), "top_k must be an integer"),
    (dict(seed=2**64), "seed must be in"),
    (dict(seed=2**64 - 1), "seed must be in"),  # the second row's seed overflows
    (dict(seed=-1), "seed must be in"),
    (dict(seed=True), "seed must be one int"),
    (dict(stop=5), "stop must be a list"),
    (dict(stop="x"), "stop must be a list"),
    (dict(stop=[b"x"]), "stop must be a list"),
    (dict(stop=["\ud800"]), "not valid Unicode"),
    (dict(k=0), "k must be an integer in [1, 16]"),
    (dict(k=17), "k must be an integer in [1, 16]"),
    (dict(k=True), "k must be an integer in [1, 16]"),
    (dict(max_new_tokens=True), "max_new_tokens"),
    (dict(max_new_tokens=10**30), "above this bundle's max_context"),
]


@pytest.mark.parametrize("kwargs, match", BAD_REQUESTS, ids=[repr(k) for k, _ in BAD_REQUESTS])
def test_bad_request_is_one_request_error(model, kwargs, match):
    kwargs = {"max_new_tokens": 2, **kwargs}
    with pytest.raises(RequestError, match=re.escape(match)):
        model.generate(["ab", "cd"], **kwargs)


@pytest.mark.parametrize("prompts, match", [
    ([[True, False]], "must be a non-empty string or list of token ids"),
    ([b"abc"], "must be a non-empty string or list of token ids"),
    (b"abc", "must be a non-empty string or list of token ids"),
    (["a\udc80b"], "prompt 0 is not valid Unicode"),
    ([[1, 10**9]], "outside the vocabulary"),
    ([[-1]], "outside the vocabulary"),
    ([[]], "must be a non-empty string"),
    ([None], "must be a non-empty string"),
    ([], "non-empty list"),
])
def test_bad_prompt_is_one_request_error(model, prompts, match):
    with pytest.raises(RequestError, match=match):
        model.generate(prompts, max_new_tokens=2)


def test_stop_none_means_no_stop_strings(model):
    assert model.generate(["ab"], max_new_tokens=2, stop=None)[0].finish_reason in ("length", "stop")


def test_per_call_stats_are_returned_with_the_result(model):
    """Concurrent calls: each result carries its own figures; last_stats is only the latest call's."""
    results = {}

    def call(n: int) -> None:
        results[n] = model.generate(["ab"] * n, max_new_tokens=3)

    threads = [threading.Thread(target=call, args=(n,)) for n in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for n, result in results.items():
        assert len(result) == n and result.stats.requests == n
        assert result.stats.new_tokens == sum(len(c.token_ids) for c in result)


CLI_CASES = [
    (["generate", "{ort}", "--prompt", "x", "--temperature", "nan"], "temperature must be a number"),
    (["generate", "{ort}", "--prompt", "x", "--temperature", "inf"], "temperature must be a number"),
    (["generate", "{ort}", "--prompt", "x", "--seed", str(2**64)], "seed must be in"),
    (["generate", "{ort}", "--prompt", "x", "--top-k", str(10**40)], "top_k must be an integer"),
    (["generate", "{ort}", "--prompt", "x", "--k", "0"], "k must be an integer in [1, 16]"),
    (["generate", "{ort}", "--prompt", "x", "--stop", ""], "stop must be a list of non-empty strings"),
    (["generate", "{ort}", "--prompts", "{binary}"], "is not UTF-8 text"),
    (["generate", "{ort}", "--prompts", "{badchat}"], "field \"chat\" must be true or false"),
    (["generate", "{ort}", "--prompts", "{surrogate}"], "not valid Unicode"),
    (["generate", "{ort}", "--prompts", "{tmp}"], "does not exist"),
    (["compile", "{binary}"], "is not UTF-8 text"),
    (["compile", "{tmp}"], "does not exist"),
    (["compile", "{nan_recipe}"], "sampling.temperature': expected a finite number"),
    (["compile", "{topp_recipe}"], "sampling.top_p': 0.0 keeps no token"),
    (["compile", "{intkeys_recipe}"], "unknown field"),
    (["compile", "{deep_recipe}"], "recipe"),
    (["compile", "{ok_recipe}", "-o", "/proc/specc-x"], "cannot write the bundle"),
    (["compile", "{ok_recipe}", "-o", "{nonbundle}"], "not a specc bundle"),
    (["compile", "{exit_recipe}"], "draft.layer': 99 is out of range"),
    (["triton", "{ort}", "--repo", "/proc/specc-x"], "cannot write the repository"),
    (["triton", "{ort}", "--repo", "{tmp}/r", "--expect-id", "sha256:" + "1" * 64], "not the expected"),
    (["bench", "{ort}", "{ort}", "--prompt", "x", "--expect-id", "sha256:" + "1" * 64], "pins one bundle"),
    (["bench", "{ort}", "--prompt", "x", "--max-new-tokens", "2", "--json", "/proc/specc-x/b.json"], "/proc/specc-x"),
    (["bench", "{ort}", "--prompt", "x", "--json", "{binary}/b.json"], "is not a folder"),  # before the run, not after
    (["bench", "{ort}", "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens 0: allowed"),
    (["eval", "{ort}", "--prompt", "x y", "--expect-id", "sha256:" + "1" * 64], "not the expected"),
    (["eval", "{ort}", "--prompt", "x y", "--json", "{binary}/e.json"], "is not a folder"),
    (["tune", "{ort}", "--prompt", "x", "--json", "{nonbundle}"], "a directory"),
    (["trt-check", "{binary}"], "is not an ONNX model"),
]


@pytest.fixture
def files(small, models_dir, tmp_path) -> dict[str, Path]:
    def recipe(name: str, text: str) -> Path:
        (tmp_path / name).write_text(text)
        return tmp_path / name

    (tmp_path / "binary").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "nonbundle").mkdir()
    (tmp_path / "nonbundle" / "precious.txt").write_text("keep me")
    target = models_dir / "target"
    return {
        "ort": small["ort"], "tmp": tmp_path / "missing", "binary": tmp_path / "binary",
        "nonbundle": tmp_path / "nonbundle",
        "badchat": recipe("chat.jsonl", '{"prompt": "x", "chat": "no"}\n'),
        "surrogate": recipe("s.jsonl", '{"prompt": "a\\ud800"}\n'),
        "nan_recipe": recipe("nan.yaml", f"target: {{model: {target}}}\ndraft: {{method: none}}\nsampling: {{temperature: .nan}}\n"),
        "topp_recipe": recipe("topp.yaml", f"target: {{model: {target}}}\ndraft: {{method: none}}\nsampling: {{top_p: 0}}\n"),
        "intkeys_recipe": recipe("int.yaml", f"target: {{model: {target}}}\n1: 2\nzz: 3\n"),
        "deep_recipe": recipe("deep.yaml", "a: " + "[" * 5000 + "]" * 5000 + "\n"),
        "ok_recipe": recipe("ok.yaml", f"target: {{model: {target}}}\ndraft: {{method: none}}\n"),
        "exit_recipe": recipe("exit.yaml", f"target: {{model: {target}}}\ndraft: {{method: early_exit, layer: 99}}\n"),
    }


@pytest.mark.parametrize("args, match", CLI_CASES, ids=[" ".join(a[:1] + a[2:4]) for a, _ in CLI_CASES])
def test_cli_bad_input_is_one_error_line(files, capsys, args, match):
    import time

    start = time.perf_counter()
    assert_one_error(*run_cli([a.format(**files) for a in args], capsys), match)
    assert time.perf_counter() - start < 30, "validated before loading weights"
    assert (files["nonbundle"] / "precious.txt").read_text() == "keep me"


def test_max_batch_zero_bundle_fails_fast_not_hangs(small, tmp_path):
    """A manifest with limits.max_batch 0 used to loop forever at full CPU."""
    b = copy_of(small["ort"], tmp_path)
    m = raw(b)
    m["recipe"]["limits"]["max_batch"] = 0
    write(b, m)
    proc = subprocess.run([sys.executable, "-m", "specc.cli", "generate", str(b), "--prompt", "x"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 2 and "recipe.limits.max_batch" in proc.stderr and "Traceback" not in proc.stderr


# -- fuzzing ------------------------------------------------------------------------------------------------
def _base_recipe(target: str) -> dict:
    return {"target": {"model": target, "dtype": "float32"},
            "draft": {"method": "early_exit", "layer": 2, "lookup": False, "max_ngram": 3, "min_ngram": 1},
            "speculation": {"mode": "chain", "k": 4, "tree": {"depth": 4, "branching": 2, "max_nodes": 16},
                            "verify_head": False},
            "sampling": {"temperature": 0.5, "top_k": 0, "top_p": 1.0},
            "limits": {"max_batch": 2, "max_context": 64}, "backend": "onnxruntime", "precision": "fp32",
            "device": "cpu", "output": "out"}


WEIRD = (st.none() | st.booleans() | st.integers(-2**80, 2**80) | st.floats() | st.text(max_size=12)
         | st.binary(max_size=8) | st.lists(st.integers(-3, 70), max_size=3) | st.lists(st.lists(st.integers(-1, 70), max_size=3), max_size=3)
         | st.dictionaries(st.text(max_size=4), st.integers(), max_size=2) | st.sampled_from(
             ["none", "model", "tree", "chain", "cuda", "torch", "aoti", "tensorrt", "int8", "fp16", "float16", ".nan", "1e400",
              "/proc/x", "../../etc", "\0", "early_exit", "prompt_lookup", "quantized"]))


def _recipe_yaml(data, target: str) -> bytes:
    recipe = _base_recipe(target)
    leaves = list(_leaves(recipe))
    for _ in range(data.draw(st.integers(1, 4))):
        path, _old = data.draw(st.sampled_from(leaves))
        if data.draw(st.booleans()) and len(path) > 1:  # sometimes replace or drop a whole section
            path = path[:-1]
        if data.draw(st.integers(0, 9)) == 0:  # drop the field
            parent = recipe
            try:
                for key in path[:-1]:
                    parent = parent[key]
                del parent[path[-1]]
            except (TypeError, KeyError, IndexError):
                pass
            continue
        try:
            _set(recipe, path, data.draw(WEIRD))
        except (TypeError, KeyError, IndexError):
            pass
    text = yaml.safe_dump(recipe, allow_unicode=True).encode("utf-8", "surrogatepass")
    mode = data.draw(st.integers(0, 7))
    if mode == 0:  # byte-level damage
        pos = data.draw(st.integers(0, max(0, len(text) - 1)))
        text = text[:pos] + data.draw(st.binary(min_size=1, max_size=6)) + text[pos + 1:]
    elif mode == 1:
        text = text[: data.draw(st.integers(0, len(text)))]
    return text


STATS = {"recipes": 0, "requests": 0, "manifests": 0, "prompt_files": 0}


def _fuzz_recipe(data, tmp_path, capsys, target: str) -> None:
    path = tmp_path / "fuzz.yaml"
    path.write_bytes(_recipe_yaml(data, target))
    STATS["recipes"] += 1
    # A recipe that passes validation compiles from a model that is not there, so every case ends in an error.
    rc, err = run_cli(["compile", path, "-o", tmp_path / "out", "-q"], capsys)
    assert_one_error(rc, err)
    assert not (tmp_path / "out").exists()


@FUZZ
@given(data=st.data())
def test_fuzzed_recipes_give_one_error_line(tmp_path_factory, capsys, data):
    _fuzz_recipe(data, tmp_path_factory.mktemp("r"), capsys, "/nonexistent/model")


REQUEST_VALUES = {
    "temperature": st.none() | st.floats() | st.integers(-5, 200) | st.booleans() | st.binary(max_size=2) | st.text(max_size=2),
    "top_k": st.none() | st.integers(-2**65, 2**65) | st.floats() | st.booleans(),
    "top_p": st.none() | st.floats() | st.integers(-1, 2) | st.booleans(),
    "seed": st.integers(-2**65, 2**65) | st.booleans() | st.lists(st.integers(-2, 2**64), max_size=3) | st.none(),
    "stop": st.none() | st.integers() | st.text(max_size=3) | st.lists(st.text(max_size=3) | st.binary(max_size=2) | st.none(), max_size=3),
    "k": st.none() | st.integers(-2, 20) | st.booleans() | st.floats(),
    "max_new_tokens": st.integers(-2, 80) | st.booleans() | st.floats() | st.none(),
    "speculative": st.booleans(),
    "chat": st.booleans(),
}
PROMPTS = st.lists(st.text(min_size=0, max_size=12) | st.lists(st.integers(-3, 300) | st.booleans(), max_size=4)
                   | st.binary(max_size=4) | st.none(), min_size=0, max_size=3) | st.text(max_size=5)


@FUZZ
@given(prompts=PROMPTS, kwargs=st.fixed_dictionaries({}, optional=REQUEST_VALUES))
def test_fuzzed_requests_answer_or_raise_request_error(model, prompts, kwargs):
    STATS["requests"] += 1
    kwargs.setdefault("max_new_tokens", 3)
    try:
        result = model.generate(prompts, **kwargs)
    except RequestError:
        return
    assert all(isinstance(c.text, str) for c in result) and result.stats.requests == len(result)


def _fuzz_manifest(data, small, tmp_path):
    b = tmp_path / "b"
    if not b.exists():
        shutil.copytree(small["ort"], b)
    base = raw(small["ort"])
    m = json.loads(json.dumps(base))
    leaves = list(_leaves(m))
    for _ in range(data.draw(st.integers(1, 3))):
        path, _old = data.draw(st.sampled_from(leaves))
        if data.draw(st.booleans()) and len(path) > 1:
            path = path[: data.draw(st.integers(1, len(path) - 1))]
        try:
            if data.draw(st.integers(0, 5)) == 0:
                parent = m
                for key in path[:-1]:
                    parent = parent[key]
                del parent[path[-1]]
            else:
                _set(m, path, data.draw(JSON_VALUES | st.sampled_from(["../x", "/etc/passwd", "torch", "aoti", "tokenizer"])))
        except (TypeError, KeyError, IndexError):
            pass
    write(b, m)
    STATS["manifests"] += 1
    try:
        bundle = open_bundle(b)
    except BundleError:
        return
    assert bundle.id == bundle_id(m)
    if bundle.id != bundle_id(base):
        with pytest.raises(BundleError):
            open_bundle(b, expect_id=bundle_id(base))


@FUZZ
@given(data=st.data())
def test_fuzzed_manifests_load_or_raise_bundle_error(small, tmp_path_factory, data):
    _fuzz_manifest(data, small, tmp_path_factory.mktemp("m"))


@FUZZ
@given(lines=st.lists(st.text(max_size=20) | st.builds(json.dumps, JSON_VALUES) | st.builds(
    lambda p, c: json.dumps({"prompt": p, "chat": c}), st.text(max_size=6) | st.integers(), JSON_VALUES), min_size=0, max_size=4),
       tail=st.binary(max_size=4))
def test_fuzzed_prompt_files_give_output_or_one_error_line(small, tmp_path_factory, capsys, lines, tail):
    path = tmp_path_factory.mktemp("p") / "prompts.txt"
    path.write_bytes("\n".join(lines).encode("utf-8", "surrogatepass") + tail)
    STATS["prompt_files"] += 1
    rc, err = run_cli(["generate", small["ort"], "--prompts", path, "--max-new-tokens", "2"], capsys)
    if rc != 0:
        assert_one_error(rc, err)


@pytest.mark.slow
@pytest.mark.heavy
@FUZZ_SLOW
@given(data=st.data())
def test_fuzzed_recipes_many(tmp_path_factory, capsys, data):
    _fuzz_recipe(data, tmp_path_factory.mktemp("r"), capsys, "/nonexistent/model")


@pytest.mark.slow
@pytest.mark.heavy
@FUZZ_SLOW
@given(data=st.data())
def test_fuzzed_manifests_many(small, tmp_path_factory, data):
    _fuzz_manifest(data, small, tmp_path_factory.mktemp("m"))


@pytest.mark.slow
@pytest.mark.heavy
@FUZZ_SLOW
@given(prompts=PROMPTS, kwargs=st.fixed_dictionaries({}, optional=REQUEST_VALUES))
def test_fuzzed_requests_many(model, prompts, kwargs):
    test_fuzzed_requests_answer_or_raise_request_error.hypothesis.inner_test(model, prompts, kwargs)


def test_report_fuzz_counts(capsys):
    """Prints how many fuzz cases ran in this session (run with -s to see it)."""
    with capsys.disabled():
        print(f"\nfuzz cases run: {STATS}")
    assert not math.isnan(sum(STATS.values()))


def test_terminal_escapes_from_a_bundle_are_not_printed(small, tmp_path, capsys):
    """File names and manifest strings reach the terminal with control characters escaped."""
    b = copy_of(small["ort"], tmp_path)
    (b / "target" / "\x1b[2Jfake").write_text("x")
    rc, err = run_cli(["inspect", b], capsys)
    assert_one_error(rc, err, "\\x1b[2Jfake: present but not listed")
    assert "\x1b" not in err
    (b / "target" / "\x1b[2Jfake").unlink()
    m = raw(b)
    m["models"]["target"] = "\x1b]0;owned\x07model"
    write(b, m)
    assert main(["inspect", str(b)]) == 0
    out = capsys.readouterr().out
    assert "\\x1b]0;owned\\x07model" in out and "\x1b" not in out
