"""llama-server baselines for `specc bench --llamacpp-server [LABEL=]URL`: a running llama.cpp server (built for
this CPU by scripts/build_llamacpp.sh, started by the user with whatever speculation it should do: none,
`--spec-type draft-simple --model-draft ...`, `ngram-mod`, `ngram-cache`, ...) fed the same prompt token ids,
greedy, the same max_new_tokens.

Each server is one system. Timing is the wall time of each `/completion` request on loopback (prefill included, as
for specc); the server's own timings (prompt and decode milliseconds, tokens drafted and accepted) are kept beside
it. A server that drafted tokens is speculative; every server's output is compared with the first server that did
not draft (llama.cpp's own target-only), or with llama-cpp-python's target-only when `--compare llamacpp` runs too.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import SpeccError
from ..runtime.stats import RowStats

TIMEOUT_S = 600.0  # one completion of a long prompt on a slow CPU


def _call(url: str, path: str, body: dict | None = None) -> dict:
    """GET (body None) or POST JSON to the server; its JSON reply, or one SpeccError naming the URL."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url.rstrip("/") + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as reply:
            return json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:300].decode(errors="replace")
        raise SpeccError(f"--llamacpp-server {url}: {path} answered {exc.code}: {detail}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise SpeccError(f"--llamacpp-server {url}: no llama-server answers there ({exc}); start one, e.g. "
                         "llama-server -m TARGET.gguf --port 8080 -t 2") from None


def parse_server(spec: str) -> tuple[str | None, str]:
    """`[LABEL=]URL` -> (label or None, URL); SpeccError for anything but an http(s) URL."""
    label, _, url = spec.partition("=") if "=" in spec.split("://")[0] else ("", "", spec)
    if not url.startswith(("http://", "https://")):
        raise SpeccError(f"--llamacpp-server {spec!r}: allowed [LABEL=]URL with an http:// or https:// URL, "
                         "e.g. ngram-mod=http://127.0.0.1:8081")
    return label or None, url


@dataclass
class LlamaServerSystem:
    name: str
    url: str
    eos_ids: list[int]
    settings: dict = field(default_factory=dict)
    family: str = "llamacpp"
    drafted: int = 0  # tokens the server drafted so far (its timings' draft_n)
    peers: list = field(default_factory=list)  # every server system of the run, this one included
    fallback_reference: str | None = None  # llama-cpp-python's target-only, when it runs too

    @property
    def speculative(self) -> bool:
        return self.drafted > 0

    @property
    def reference(self) -> str | None:
        """The system this one's outputs are compared with: llama.cpp's own target-only."""
        if self.fallback_reference:
            return self.fallback_reference
        return next((p.name for p in self.peers if not p.speculative), None)

    def run(self, prompts: list[list[int]], max_new_tokens: int) -> dict:
        tokens, per_prompt, seconds, prefill = [], [], 0.0, 0.0
        for i, ids in enumerate(prompts):
            out, reason, took, timings = self.generate(ids, max_new_tokens)
            tokens.append(out)
            seconds += took
            prefill += timings.get("prompt_ms", 0.0) / 1e3
            per_prompt.append({"prompt": i, "new_tokens": len(out), "finish_reason": reason, "seconds": took,
                               "tokens_per_second": len(out) / took if took else None, "server_timings": timings})
        n = sum(len(t) for t in tokens)
        summary = {"requests": len(prompts), "new_tokens": n, "seconds": seconds,
                   "tokens_per_second": n / seconds if seconds else None, "prefill_seconds": prefill,
                   "draft_seconds": None, "target_seconds": None, "host_seconds": None, **RowStats().to_dict()}
        return {"summary": summary, "tokens": tokens, "per_prompt": per_prompt}

    def generate(self, ids: list[int], max_new_tokens: int) -> tuple[list[int], str, float, dict]:
        body = {"prompt": ids, "n_predict": max_new_tokens, "temperature": 0.0, "top_k": 1, "seed": 0,
                "cache_prompt": False, "return_tokens": True, "stream": False}
        start = time.perf_counter()
        reply = _call(self.url, "/completion", body)
        took = time.perf_counter() - start
        if not isinstance(reply.get("tokens"), list):
            raise SpeccError(f"--llamacpp-server {self.url}: its /completion reply has no token ids (`tokens`); "
                             "a llama-server that takes `return_tokens` is needed (scripts/build_llamacpp.sh)")
        out = [int(t) for t in reply["tokens"]]
        stop = next((i for i, t in enumerate(out) if t in self.eos_ids), None)
        if stop is not None:
            out = out[:stop]
        timings = reply.get("timings") or {}
        self.drafted += int(timings.get("draft_n") or 0)
        reason = "stop" if stop is not None or reply.get("stopped_eos") else "length"
        return out, reason, took, timings


def server_systems(specs: list[str], eos_ids: list[int], fallback_reference: str | None) -> list[LlamaServerSystem]:
    """One system per `[LABEL=]URL`, named `llama-server LABEL` (default: the URL's host and port)."""
    systems: list[LlamaServerSystem] = []
    for spec in specs:
        label, url = parse_server(spec)
        props = _call(url, "/props")
        model = props.get("model_path") or "?"
        name = f"llama-server {label or url.split('://', 1)[1].rstrip('/')}"
        if any(s.name == name for s in systems):
            raise SpeccError(f"--llamacpp-server: two servers named {name!r}; give each a LABEL= of its own")
        systems.append(LlamaServerSystem(name, url, list(eos_ids), {"url": url, "model_path": model,
                                                                    "build": props.get("build_info")},
                                         fallback_reference=fallback_reference))
    for s in systems:
        s.peers = systems
    return systems


def server_target_gguf(systems: list[LlamaServerSystem]) -> str | None:
    """The GGUF the first server runs (for the bandwidth lines), when it says and the file is on this machine."""
    paths = [s.settings.get("model_path") for s in systems if s.settings.get("model_path") not in (None, "?")]
    return paths[0] if paths and Path(paths[0]).is_file() else None
