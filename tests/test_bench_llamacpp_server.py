"""`specc bench --llamacpp-server [LABEL=]URL`: running llama-servers as baselines (bench/llamacpp_server.py),
against fake servers that speak llama-server's /props and /completion."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from specc.bench.llamacpp_server import parse_server, server_systems
from specc.cli import main
from specc.errors import SpeccError

EOS = 7


def _fake_server(drafts: int, eos_after: int | None = None, tokens: bool = True):
    """A llama-server stand-in: greedy output is prompt[-1] + 1, + 2, ...; `drafts` tokens drafted per request; an
    EOS after `eos_after` tokens."""
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _reply(self, body: dict):
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._reply({"model_path": "/models/target.gguf", "build_info": "b1-test"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body)
            out = [100 + (body["prompt"][-1] + i) % 50 for i in range(1, body["n_predict"] + 1)]
            if eos_after is not None:
                out = out[:eos_after] + [EOS]
            reply = {"content": "", "timings": {"prompt_ms": 5.0, "predicted_ms": 20.0, "draft_n": drafts}}
            if tokens:
                reply["tokens"] = out
            self._reply(reply)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}", seen


@pytest.fixture
def servers():
    made = []

    def make(**kw):
        server, url, seen = _fake_server(**kw)
        made.append(server)
        return url, seen
    yield make
    for s in made:
        s.shutdown()


def test_servers_are_systems_compared_with_the_one_that_does_not_draft(servers):
    (to_url, seen), (spec_url, _) = servers(drafts=0), servers(drafts=3, eos_after=2)
    spec, target_only = server_systems([f"spec={spec_url}", f"to={to_url}"], [EOS], None)
    assert (spec.name, target_only.name) == ("llama-server spec", "llama-server to")
    out = target_only.run([[1, 2, 3], [4, 5]], 4)
    assert out["tokens"] == [[104, 105, 106, 107], [106, 107, 108, 109]]
    assert seen[0] == {"prompt": [1, 2, 3], "n_predict": 4, "temperature": 0.0, "top_k": 1, "seed": 0,
                       "cache_prompt": False, "return_tokens": True, "stream": False}
    assert out["summary"]["prefill_seconds"] == pytest.approx(0.01)
    out = spec.run([[1, 2, 3]], 4)
    assert out["tokens"] == [[104, 105]] and out["per_prompt"][0]["finish_reason"] == "stop"  # EOS cut, as specc's
    assert spec.speculative and not target_only.speculative
    assert spec.reference == target_only.reference == "llama-server to"
    assert server_systems([to_url], [EOS], "llama.cpp target-only")[0].reference == "llama.cpp target-only"


def test_bad_servers_are_one_clear_error(servers):
    with pytest.raises(SpeccError, match=r"allowed \[LABEL=\]URL with an http:// or https:// URL"):
        parse_server("localhost:8080")
    assert parse_server("ngram=http://h:1/?a=b") == ("ngram", "http://h:1/?a=b")
    with pytest.raises(SpeccError, match="http://127.0.0.1:9: no llama-server answers there"):
        server_systems(["http://127.0.0.1:9"], [EOS], None)
    url, _ = servers(drafts=0, tokens=False)
    with pytest.raises(SpeccError, match="has no token ids"):
        server_systems([url], [EOS], None)[0].run([[1]], 2)
    url, _ = servers(drafts=0)
    with pytest.raises(SpeccError, match="two servers named"):
        server_systems([f"a={url}", f"a={url}"], [EOS], None)


def test_bench_runs_servers_beside_specc(bundles, servers, tmp_path):
    (to_url, _), (spec_url, _) = servers(drafts=0), servers(drafts=2)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "abc abc abc abc", "kind": "code"}\n{"prompt": "def f(x):", "kind": "code"}\n')
    out = tmp_path / "bench.json"
    assert main(["bench", str(bundles["prompt_lookup"]), "--prompts", str(prompts), "--max-new-tokens", "6",
                 "--llamacpp-server", f"target-only={to_url}", "--llamacpp-server", f"ngram={spec_url}",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    systems = result["systems"]
    assert systems["llama-server ngram"]["speculative"] and not systems["llama-server target-only"]["speculative"]
    assert systems["llama-server ngram"]["equality_reference"] == "llama-server target-only"
    assert systems["llama-server ngram"]["outputs_equal"] == "2/2"
    assert result["llamacpp"]["target_gguf"] is None  # the fake server's GGUF is not on this machine
    assert any("llama-server target-only" in line for line in result["goal"])
    assert main(["bench", str(bundles["prompt_lookup"]), "--prompts", str(prompts), "--llamacpp-server", "nope"]) == 2
