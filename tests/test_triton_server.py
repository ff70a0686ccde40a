"""A real tritonserver (Triton 2.51 from the nvidia-pytriton wheel, python backend, CPU) serving
repositories that `specc triton` writes, started with examples/triton/serve.sh on free 127.0.0.1
ports and stopped by its PID.

Needs the server's Python environment (`make triton-env`: a venv of the system python3.11, which
the python-backend stub links). Without it these tests skip, unless SPECC_REQUIRE_TRITON=1
(set by .ci/run), where they fail.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

import specc
from specc.cli import main
from specc.triton.client import stream_many

pytestmark = pytest.mark.triton_server

ROOT = Path(__file__).resolve().parents[1]
TRITON_ENV = Path(os.environ.get("SPECC_TRITON_ENV", ROOT / ".venv-triton"))
PROMPTS = ["hello", "def f(x):", "abc abc abc", "import os\n", "x = 1", "the cat sat", "(((", "zq", "return a + b", "w"]
MAX_TOKENS = 24


def _environment_problem() -> str | None:
    python = TRITON_ENV / "bin" / "python"
    if not python.exists():
        return f"no Triton server environment at {TRITON_ENV}"
    check = subprocess.run([str(python), "-c", "import pytriton, specc.triton.serving"], capture_output=True, text=True,
                           timeout=300)
    if check.returncode:
        return f"the Triton server environment {TRITON_ENV} is broken: {check.stderr.strip()[-400:]}"
    return None


@pytest.fixture(scope="module")
def triton_env() -> Path:
    problem = _environment_problem()
    if problem:
        message = f"{problem}; build it with `make triton-env`"
        if os.environ.get("SPECC_REQUIRE_TRITON") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return TRITON_ENV


@contextmanager
def serving(repo: Path, models: list[str], workdir: Path):
    from specc.triton.local_server import LocalServer

    server = LocalServer([str(ROOT / "examples" / "triton" / "serve.sh")], repo, workdir / "server.log", workdir / "work")
    try:
        server.start(models)
        yield server
    finally:
        code = server.stop()
        pid = server.process.pid
        print(f"tritonserver pid {pid} stopped with exit code {code}; log {server.log_path}")
    assert code == 0, server.log_tail()
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)  # neither the server nor a python-backend stub is left


@pytest.fixture(scope="module")
def reference(bundles):
    """Greedy completions of PROMPTS by in-process `specc generate` (texts) and the runtime (token ids)."""
    import contextlib
    import io

    out = io.StringIO()
    args = ["generate", str(bundles["draft"]), "--max-new-tokens", str(MAX_TOKENS), "--json"]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert main(args + [a for p in PROMPTS for a in ("--prompt", p)]) == 0
    texts = json.loads(out.getvalue())["completions"]
    ids = [c.token_ids for c in specc.load(bundles["draft"]).generate(PROMPTS, max_new_tokens=MAX_TOKENS)]
    return list(zip(texts, ids))


@pytest.fixture(scope="module")
def in_process_server(triton_env, bundles, tmp_path_factory):
    root = tmp_path_factory.mktemp("triton")
    assert main(["triton", str(bundles["draft"]), "--repo", str(root / "repo"), "--name", "spec"]) == 0
    with serving(root / "repo", ["spec"], root) as server:
        yield server


def check_results(results, reference) -> None:
    for r, (text, ids) in zip(results, reference):
        assert r.error is None, r.error
        assert (r.text, r.output_ids) == (text, ids)
        assert r.num_output_tokens == len(ids) and r.finish_reason in ("stop", "length")
        assert r.responses > 1 or len(ids) <= 1  # streamed as rounds were accepted
        assert r.speculation_stats["drafted"] > 0 or len(ids) <= 1


def test_concurrent_streams_equal_specc_generate_and_bad_requests_fail_alone(in_process_server, reference):
    good = [{"text_input": p, "max_tokens": MAX_TOKENS} for p in PROMPTS]
    bad = [{"text_input": "hello", "max_tokens": -5}, {"text_input": ""}]
    results = stream_many(in_process_server.grpc_url, "spec", good[:5] + bad + good[5:], timeout=120)
    check_results(results[:5] + results[7:], reference)
    assert results[5].error == "max_tokens must be >= 1, got -5"
    assert results[6].error == "text_input is empty; send a prompt of at least one character"


def test_example_client_script(in_process_server, reference):
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "triton" / "stream_client.py"), "--url", in_process_server.grpc_url,
         "--model", "spec", "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--max-new-tokens", str(MAX_TOKENS), "--json"],
        capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    results = json.loads(run.stdout)
    assert [(r["text"], r["output_ids"]) for r in results] == [tuple(x) for x in reference[:2]]


def test_http_generate_endpoints(in_process_server, reference):
    def post(endpoint: str, body: dict) -> str:
        request = urllib.request.Request(f"http://{in_process_server.http_url}/v2/models/spec/{endpoint}",
                                         data=json.dumps(body).encode(), method="POST")
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.read().decode()

    events = [json.loads(line[len("data: "):]) for line in post(
        "generate_stream", {"text_input": PROMPTS[1], "max_tokens": MAX_TOKENS}).splitlines() if line.startswith("data: ")]
    assert "".join(e["text_output"] for e in events) == reference[1][0]
    assert events[-1]["finish_reason"] in ("stop", "length") and "speculation_stats" in events[-1]
    whole = json.loads(post("generate", {"text_input": PROMPTS[1], "max_tokens": MAX_TOKENS, "stream": False}))
    assert whole["text_output"] == reference[1][0]


def test_split_layout_engines_called_with_bls(triton_env, bundles, reference, tmp_path):
    assert main(["triton", str(bundles["draft"]), "--repo", str(tmp_path / "repo"), "--name", "spec",
                 "--layout", "split", "--engines", "python"]) == 0
    with serving(tmp_path / "repo", ["spec", "spec_target", "spec_draft"], tmp_path) as server:
        requests = [{"text_input": p, "max_tokens": MAX_TOKENS} for p in PROMPTS]
        check_results(stream_many(server.grpc_url, "spec", requests, timeout=120), reference)
