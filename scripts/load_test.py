"""Load test of `specc serve` with the official openai client: adaptive k vs fixed k vs no speculation.

Starts one `specc serve` process per mode on the same bundle (they idle while another mode runs),
then for each concurrency level runs the same request mix against each mode in turn:
streaming greedy completions of mixed code (/v1/completions) and chat (/v1/chat/completions)
prompts, with bad requests (must answer 400) and clients that disconnect mid-stream mixed in.
Every finished greedy completion must equal `specc generate` of the same prompt (computed here
with the target alone, which speculation must reproduce token for token); a lost request (an
error, a missing finish) or a wrong text is counted and fails the run.

    python scripts/load_test.py /tmp/quickstart --concurrency 1 4 16 64 --json /tmp/load.json

Reports throughput (completion tokens per second of wall time), p50/p99 time to first token
and p50/p99 inter-token latency (per request: (last - first token time) / (tokens - 1)). Before
the levels every server answers `--warmup` requests (default 4), so the figures are those of a
server that has run for a while, not of its first minute (k auto learns costs and acceptance
from nothing when a server starts: about 1% of the first 16 requests' throughput on the Qwen pair).
Modes take turns within a level, in slices whose order reverses every slice (`--slices`, default 2);
with many slices, e.g. `--concurrency 1 --requests 64 --slices 16`, each pair of modes is compared
slice by slice, which takes the machine's drift out of a small difference and gives its spread.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import openai

try:  # the HTTP client the openai package depends on (httpx2 in openai >= 2.x, httpx before)
    import httpx2 as httpx
except ImportError:
    import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from server_probe import LiveServer  # noqa: E402  (the launcher the server tests use)


@dataclass
class Task:
    kind: str  # "ok", "bad", "disconnect"
    item: dict  # {"prompt", "chat"}


@dataclass
class Result:
    ok: bool
    kind: str
    ttft: float | None = None
    itl: float | None = None
    tokens: int = 0
    problem: str | None = None


@dataclass
class Level:
    mode: str
    concurrency: int
    seconds: float
    results: list[Result] = field(default_factory=list)
    slices: list[float] = field(default_factory=list)  # tokens per second of each slice of the level

    def tokens(self) -> int:
        return sum(r.tokens for r in self.results if r.kind == "ok" and r.ok)

    def summary(self) -> dict:
        done = [r for r in self.results if r.kind == "ok" and r.ok]
        ttft = sorted(r.ttft for r in done if r.ttft is not None)
        itl = sorted(r.itl for r in done if r.itl is not None)
        tokens = self.tokens()
        return {
            "mode": self.mode, "concurrency": self.concurrency, "requests": len(self.results),
            "completed": len(done), "problems": [r.problem for r in self.results if not r.ok],
            "tokens": tokens, "seconds": self.seconds, "tokens_per_second": tokens / self.seconds,
            "ttft_p50": _pct(ttft, 50), "ttft_p99": _pct(ttft, 99), "itl_p50": _pct(itl, 50), "itl_p99": _pct(itl, 99),
            "slices": self.slices,
        }


def paired_ratio(a: list[float], b: list[float]) -> tuple[float, float]:
    """Mean and standard error of a[i] / b[i] over the slices two modes ran in turn."""
    ratios = [x / y for x, y in zip(a, b)]
    mean = sum(ratios) / len(ratios)
    var = sum((r - mean) ** 2 for r in ratios) / (len(ratios) - 1)
    return mean, (var / len(ratios)) ** 0.5


def _pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def start_server(bundle: Path, mode: str, k: int) -> LiveServer:
    """`specc serve BUNDLE` in one speculation mode on a free loopback port, once /health answers."""
    args = ["--no-verify", "--max-queue", "1024"]
    args += {"auto": ["--k", "auto"], "fixed": ["--k", str(k)], "none": ["--no-speculation"]}[mode]
    return LiveServer(bundle, Path(tempfile.gettempdir()) / f"specc-serve-{mode}.log", *args, name="bundle",
                      start_timeout=150)


async def run_task(client: openai.AsyncOpenAI, task: Task, max_tokens: int, want: dict) -> Result:
    item = task.item
    kwargs = {"model": "bundle", "max_tokens": max_tokens, "temperature": 0, "stream": True,
              "stream_options": {"include_usage": True}}
    if task.kind == "bad":
        kwargs["max_tokens"] = -1
    start = time.perf_counter()
    try:
        if item["chat"]:
            stream = await client.chat.completions.create(messages=[{"role": "user", "content": item["prompt"]}], **kwargs)
        else:
            stream = await client.completions.create(prompt=item["prompt"], **kwargs)
    except openai.BadRequestError:
        return Result(task.kind == "bad", task.kind, problem=None if task.kind == "bad" else "unexpected 400")
    except openai.APIError as exc:
        return Result(False, task.kind, problem=f"{type(exc).__name__}: {exc}")
    if task.kind == "bad":
        return Result(False, task.kind, problem="a bad request was accepted")
    text, first, last, chunks, tokens, reason = "", None, None, 0, 0, None
    try:
        async for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            if not chunk.choices:
                continue
            c = chunk.choices[0]
            piece = c.delta.content if item["chat"] else c.text
            if piece:
                now = time.perf_counter()
                first = first or now
                last = now
                text += piece
                chunks += 1
            reason = c.finish_reason or reason
            if task.kind == "disconnect" and chunks >= 2:
                await stream.close()
                return Result(True, task.kind)
    except openai.APIError as exc:
        return Result(False, task.kind, problem=f"stream failed: {exc}")
    if task.kind == "disconnect":  # finished before it could disconnect
        return Result(True, task.kind)
    if reason is None:
        return Result(False, task.kind, problem="no finish_reason: the stream ended early")
    expected = want.get((item["prompt"], item["chat"]))
    if expected is not None and text != expected:
        return Result(False, task.kind, problem=f"wrong text for {item['prompt'][:40]!r}")
    itl = (last - first) / (tokens - 1) if tokens > 1 and first is not None else None
    return Result(True, task.kind, ttft=(first - start) if first else None, itl=itl, tokens=tokens)


async def run_level(url: str, mode: str, concurrency: int, tasks: list[Task], max_tokens: int, want: dict) -> Level:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    todo = list(tasks)
    results: list[Result] = []

    async def worker():
        while todo:
            results.append(await run_task(client, todo.pop(0), max_tokens, want))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    level = Level(mode, concurrency, time.perf_counter() - start, results)
    await client.close()
    return level


def make_tasks(items: list[dict], n: int, offset: int) -> list[Task]:
    """n requests cycling through the prompts; every 7th a bad request, every 5th disconnects."""
    tasks = []
    for i in range(n):
        j = i + offset
        kind = "bad" if j % 7 == 3 else "disconnect" if j % 5 == 4 else "ok"
        tasks.append(Task(kind, items[j % len(items)]))
    return tasks


def format_table(rows: list[dict]) -> str:
    base = {(r["concurrency"]): r for r in rows if r["mode"] == "none"}
    lines = ["| concurrency | mode | requests | greedy streams checked | lost or wrong | tokens/s | vs none "
             "| TTFT p50 | TTFT p99 | ITL p50 | ITL p99 |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    ms = lambda v: "-" if v is None else f"{v * 1e3:.0f} ms"  # noqa: E731
    for r in rows:
        b = base.get(r["concurrency"])
        ratio = f"{r['tokens_per_second'] / b['tokens_per_second']:.2f}x" if b else "-"
        lines.append(f"| {r['concurrency']} | {r['mode']} | {r['requests']} | {r['completed']} | {len(r['problems'])} | "
                     f"{r['tokens_per_second']:.1f} | {ratio} | {ms(r['ttft_p50'])} | {ms(r['ttft_p99'])} | "
                     f"{ms(r['itl_p50'])} | {ms(r['itl_p99'])} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--requests", type=int, default=None, help="requests per level (default: max(32, concurrency))")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="max_tokens of every request")
    # the earlier name, hidden: commands written with it keep working
    ap.add_argument("--max-tokens", type=int, dest="max_new_tokens", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    ap.add_argument("--code", type=int, default=16, help="code prompts (specc.prompts)")
    ap.add_argument("--chat", type=int, default=16, help="chat prompts")
    ap.add_argument("--k", type=int, default=None, help="the fixed k compared (default: the recipe's)")
    ap.add_argument("--modes", nargs="+", default=["auto", "fixed", "none"], choices=["auto", "fixed", "none"])
    ap.add_argument("--warmup", type=int, default=4,
                    help="requests (of --max-new-tokens each) every server answers before the levels (0: one of 8 tokens)")
    ap.add_argument("--slices", type=int, default=2,
                    help="a level runs in up to this many slices of at least its concurrency in requests, the modes "
                         "taking turns in an order reversed every slice; from 3 slices on, each pair of modes is also "
                         "compared slice by slice (mean ratio and its standard error)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    import specc
    from specc.prompts import build

    items = build(args.code, args.chat)
    model = specc.load(args.bundle, verify=False)
    k = args.k or model.k
    print(f"reference: `specc generate` (target only, greedy) of {len(items)} prompts ...", flush=True)
    want = {}
    for chat in (False, True):
        chosen = [it for it in items if bool(it.get("chat")) == chat]
        done = model.generate([it["prompt"] for it in chosen], chat=chat, max_new_tokens=args.max_new_tokens,
                              speculative=False, temperature=0.0)
        want.update({(it["prompt"], chat): c.text for it, c in zip(chosen, done)})
    items = [{"prompt": it["prompt"], "chat": bool(it.get("chat"))} for it in items]
    del model

    servers: dict[str, LiveServer] = {}
    rows = []
    try:
        for mode in args.modes:
            servers[mode] = start_server(args.bundle, mode, k)
        # warm-up, every mode alike: a long-running server's adaptive policy has learned its costs and the
        # drafter's acceptance long before; a fresh one learns them over its first few hundred rounds
        warmup = [Task("ok", items[i % len(items)]) for i in range(max(args.warmup, 1))]
        for mode, url in ((m, server.url) for m, server in servers.items()):
            asyncio.run(run_level(url, mode, 1, warmup, args.max_new_tokens if args.warmup else 8, {}))
        offset = 0
        for c in args.concurrency:
            n = args.requests or max(32, c)
            tasks = make_tasks(items, n, offset)
            offset += n
            # Modes take turns on the same requests. A slow drift of the machine's speed (it moves a few
            # percent over minutes here) would favour whichever mode runs first, so a level that holds
            # at least two rounds of its concurrency runs in slices (default two: A B C then C B A), and
            # each mode's figures cover all; a level that does not alternates the order with the next level.
            order = [(m, server.url) for m, server in servers.items()]
            if len(rows) // len(order) % 2:
                order = order[::-1]
            count = max(1, min(args.slices, n // c))
            parts = [tasks[i * n // count:(i + 1) * n // count] for i in range(count)]
            levels: dict[str, Level] = {}
            for i, part in enumerate(parts):
                for mode, url in (order if i % 2 == 0 else order[::-1]):
                    level = asyncio.run(run_level(url, mode, c, part, args.max_new_tokens, want))
                    levels.setdefault(mode, Level(mode, c, 0.0))
                    levels[mode].seconds += level.seconds
                    levels[mode].results += level.results
                    levels[mode].slices.append(level.tokens() / level.seconds)
            for mode, level in levels.items():
                s = level.summary()
                rows.append(s)
                print(f"c={c:<3} {mode:<6} {s['completed']}/{n} ok, {len(s['problems'])} problems, "
                      f"{s['tokens_per_second']:.1f} tok/s, TTFT p50 {s['ttft_p50']}", flush=True)
                for p in s["problems"][:5]:
                    print(f"    problem: {p}", flush=True)
            names = list(levels)
            for i, a in enumerate(names):
                for b in names[i + 1:] if count >= 3 else ():
                    mean, se = paired_ratio(levels[a].slices, levels[b].slices)
                    print(f"c={c:<3} {a}/{b} {mean:.3f} +- {se:.3f} (mean of {count} slices +- standard error)", flush=True)
            # every server must still be healthy after the mix of bad requests and disconnects
            for mode, url in ((m, server.url) for m, server in servers.items()):
                assert httpx.get(url + "/health", timeout=5).status_code == 200, f"{mode} server unhealthy"
        metrics = {mode: httpx.get(server.url + "/metrics", timeout=5).text for mode, server in servers.items()}
    finally:
        for server in servers.values():
            server.close(20)
    table = format_table(rows)
    print(table)
    problems = sum(len(r["problems"]) for r in rows)
    print(f"problems (lost or wrong responses): {problems}")
    if args.json:
        ks = {mode: [line for line in text.splitlines() if line.startswith("specc:spec_decode_k_bucket")]
              for mode, text in metrics.items()}
        args.json.write_text(json.dumps({"bundle": str(args.bundle), "max_tokens": args.max_new_tokens, "rows": rows,
                                         "k_histogram": ks, "table": table}, indent=2))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
