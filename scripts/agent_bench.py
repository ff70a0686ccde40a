"""An agent workload through `specc serve`: multi-turn tool calling, target-only against each drafter.

A scripted coding agent works on a small in-memory Python repository through five tools (list_files,
read_file, search, run_tests, write_file). Each episode is one task (fix a bug, add a function, rename
one); the agent sends the conversation with the tools, runs the calls the model makes, feeds their results
back, and goes on until the plan ends, the model answers in text, or the episode reaches --max-steps turns. The tools are
deterministic functions of their arguments and of the files written so far.

Target-only (the first bundle served with --no-speculation) runs the episodes live and sets the
conversation. Every other system is a fresh `specc serve` of a bundle, sent the same requests in the
same order (the reference's turns replayed), so all systems see the same traffic; each reply (text, calls,
finish reason) must equal target-only's. A suffix drafter learns from the earlier episodes' outputs, as it
would in an agent's session. Greedy, one request at a time.

    python scripts/agent_bench.py /tmp/ab/lookup /tmp/ab/suffix /tmp/ab/draft --json out.json

Per system: completion tokens per second of request time (prefill of each turn's new text included),
tokens per target pass from the server's /metrics (accepted drafts + rounds, over rounds), and the replies
equal to target-only's. The first bundle also gives the target-only reference, so all bundles must share
one target. --tool-choice plan (the default) names each step's tool (list_files, read_file twice, search,
write_file, run_tests), then asks for an answer in text (none): small models answer `auto` in prose rather
than with a call. auto and required (until the tests pass) are for models that pick their own tools.
--conversation FILE has every system, target-only included, follow a results file's conversation.
"""
from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
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

SYSTEM = ("You are a coding agent in a Python repository. Work with the tools: look at the code, make the change "
          "with write_file (the whole new file), run the tests, and when they pass reply with one sentence "
          "saying what you changed.")

REPO = {
    "inventory/stock.py": '''"""Stock levels by item name."""


class Stock:
    def __init__(self):
        self.levels = {}

    def add(self, item, count):
        if count <= 0:
            raise ValueError("count must be positive")
        self.levels[item] = self.levels.get(item, 0) + count

    def remove(self, item, count):
        self.levels[item] = self.levels.get(item, 0) - count

    def level(self, item):
        return self.levels.get(item, 0)
''',
    "inventory/money.py": '''"""Prices in cents."""


def fmt_price(cents):
    return f"${cents // 100}.{cents % 100:02d}"


def parse_price(text):
    dollars, _, cents = text.lstrip("$").partition(".")
    return int(dollars) * 100 + int(cents or 0)
''',
    "inventory/report.py": '''"""Reports over a Stock and a price list."""
from .money import fmt_price


def low_stock(stock, threshold):
    return sorted(item for item, n in stock.levels.items() if n < threshold)


def price_list(prices):
    return [f"{item}: {fmt_price(cents)}" for item, cents in sorted(prices.items())]
''',
    "tests/test_stock.py": '''import pytest
from inventory.stock import Stock


def test_add_and_level():
    s = Stock()
    s.add("bolt", 3)
    assert s.level("bolt") == 3


def test_remove_more_than_held_fails():
    s = Stock()
    s.add("bolt", 2)
    with pytest.raises(ValueError):
        s.remove("bolt", 5)
''',
    "tests/test_money.py": '''from inventory.money import format_price, parse_price


def test_format_price():
    assert format_price(1205) == "$12.05"


def test_round_trip():
    assert parse_price(format_price(99)) == 99
''',
    "tests/test_report.py": '''from inventory.report import low_stock, total_value
from inventory.stock import Stock


def test_low_stock():
    s = Stock()
    s.add("nut", 1)
    s.add("bolt", 9)
    assert low_stock(s, 5) == ["nut"]


def test_total_value():
    s = Stock()
    s.add("nut", 2)
    assert total_value(s, {"nut": 150}) == 300
''',
}


@dataclass(frozen=True)
class Task:
    """One episode: the user's request and the check its test file needs to pass."""
    name: str
    request: str
    test_file: str
    fixed: str  # a regular expression the fixed file must match
    file: str
    failure: str


TASKS = [
    Task("stock", "tests/test_stock.py fails: removing more than is held should raise ValueError. Fix the code.",
         "tests/test_stock.py", r"def remove\(self, item, count\):(?:\n.*?)*?raise ValueError", "inventory/stock.py",
         "E       Failed: DID NOT RAISE <class 'ValueError'>"),
    Task("money", "tests/test_money.py cannot import format_price. Rename fmt_price to format_price everywhere.",
         "tests/test_money.py", r"def format_price\(", "inventory/money.py",
         "E   ImportError: cannot import name 'format_price' from 'inventory.money'"),
    Task("report", "Add total_value(stock, prices) to inventory/report.py: the sum of count times price in cents "
         "over the items in stock. tests/test_report.py tests it.",
         "tests/test_report.py", r"def total_value\(", "inventory/report.py",
         "E   ImportError: cannot import name 'total_value' from 'inventory.report'"),
]


def _tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


TOOLS = [
    _tool("list_files", "List the repository's files.", {}, []),
    _tool("read_file", "Read a file.", {"path": {"type": "string"}}, ["path"]),
    _tool("search", "Lines containing a text, as path:line: text.", {"text": {"type": "string"}}, ["text"]),
    _tool("run_tests", "Run the tests (all, or one test file).", {"path": {"type": "string"}}, []),
    _tool("write_file", "Replace a file's whole content.", {"path": {"type": "string"}, "content": {"type": "string"}},
          ["path", "content"]),
]


class Workspace:
    """The repository an episode works on, and what each tool answers: deterministic in its arguments."""

    def __init__(self, task: Task):
        self.task, self.files = task, dict(REPO)

    def call(self, name: str, arguments: str) -> str:
        try:
            args = json.loads(arguments)
        except json.JSONDecodeError:
            return "error: the call was cut short; send it again whole"
        tool = getattr(self, "tool_" + name, None)
        try:
            return tool(**args) if tool else f"error: no tool {name}"
        except TypeError:  # arguments the tool does not take
            return f"error: bad arguments for {name}"

    def tool_list_files(self) -> str:
        return "\n".join(sorted(self.files))

    def tool_read_file(self, path: str) -> str:
        return self.files.get(path, f"error: no file {path}")

    def tool_search(self, text: str) -> str:
        hits = [f"{path}:{no}: {line}" for path, body in sorted(self.files.items())
                for no, line in enumerate(body.splitlines(), 1) if text and text in line]
        return "\n".join(hits[:20]) or "no matches"

    def tool_write_file(self, path: str, content: str) -> str:
        self.files[path] = content
        return f"wrote {len(content)} characters to {path}"

    def tool_run_tests(self, path: str = "") -> str:
        task = self.task
        files = [f for f in sorted(self.files) if f.startswith("tests/") and f.startswith(path.rstrip("/"))]
        failing = task.test_file in files and not re.search(task.fixed, self.files.get(task.file, ""))
        passed = sum(self.files[f].count("def test_") for f in files) - failing
        if not failing:
            return f"{passed} passed"
        return (f"FAILED {task.test_file}\n{task.failure}\n"
                f"1 failed, {passed} passed")


@dataclass
class Turn:
    """One request of an episode and its reply."""
    messages: list[dict]
    tool_choice: str
    reply: dict = field(default_factory=dict)  # content, calls [(name, arguments)], finish
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    seconds: float = 0.0


def ask(client: openai.OpenAI, model: str, turn: Turn, max_tokens: int) -> None:
    """Send one turn (greedy) and record its reply, token counts and time."""
    start = time.perf_counter()
    r = client.chat.completions.create(model=model, messages=turn.messages, tools=TOOLS, tool_choice=turn.tool_choice,
                                       temperature=0, max_tokens=max_tokens)
    turn.seconds = time.perf_counter() - start
    c = r.choices[0]
    turn.reply = {"content": c.message.content, "finish": c.finish_reason,
                  "calls": [[t.function.name, t.function.arguments] for t in c.message.tool_calls or []]}
    turn.completion_tokens, turn.prompt_tokens = r.usage.completion_tokens, r.usage.prompt_tokens
    details = r.usage.prompt_tokens_details
    turn.cached_tokens = (details.cached_tokens or 0) if details else 0
    calls = ", ".join(name for name, _ in turn.reply["calls"]) or "text"
    choice = turn.tool_choice if isinstance(turn.tool_choice, str) else turn.tool_choice["function"]["name"]
    print(f"  turn ({choice}): {calls}, {turn.completion_tokens} tokens in {turn.seconds:.1f} s", file=sys.stderr)


PLAN = ["list_files", "read_file", "read_file", "search", "write_file", "run_tests"]


def next_choice(step: int, max_steps: int, policy: str, results: list[str]) -> str | dict:
    """plan: the tool of each step named (PLAN), then an answer in text (none). auto: every turn. required: a call on
    every turn until the tests pass (or the last turn), then an answer in text, as an agent that checks the tests
    itself would ask."""
    if policy == "plan":
        return {"type": "function", "function": {"name": PLAN[step]}} if step < len(PLAN) else "none"
    if policy == "auto":
        return "auto"
    done = any(r.endswith(" passed") and "failed" not in r for r in results)
    return "none" if done or step == max_steps - 1 else "required"


def episode(client: openai.OpenAI, model: str, index: int, task: Task, max_steps: int, max_tokens: int,
            policy: str, script: list[dict] | None = None) -> list[Turn]:
    """The agent loop on one task: call the model, run its tool calls, feed the results back. With a script (the
    reference's replies) the history follows the script, so every system is sent the reference's requests."""
    work = Workspace(task)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.request}]
    turns: list[Turn] = []
    results: list[str] = []
    steps = len(script) if script else len(PLAN) + 1 if policy == "plan" else max_steps
    for step in range(steps):
        choice = script[step]["tool_choice"] if script else next_choice(step, max_steps, policy, results)
        turn = Turn(list(messages), choice)
        ask(client, model, turn, max_tokens)
        turns.append(turn)
        reply = script[step] if script else turn.reply
        calls = reply["calls"]
        if not calls:
            break
        ids = [f"call_{index}_{step}_{i}" for i in range(len(calls))]
        messages.append({"role": "assistant", "content": reply["content"], "tool_calls": [
            {"id": i, "type": "function", "function": {"name": n, "arguments": _whole_json(a)}}
            for i, (n, a) in zip(ids, calls)]})
        results = [work.call(n, a) for n, a in calls]
        messages += [{"role": "tool", "tool_call_id": i, "content": r} for i, r in zip(ids, results)]
    return turns


def _whole_json(arguments: str) -> str:
    """A call cut short by max_tokens goes back into the history as an empty call (the server takes only JSON)."""
    try:
        json.loads(arguments)
        return arguments
    except json.JSONDecodeError:
        return "{}"


def conversation(episodes: list[list[Turn]]) -> list[list[dict]]:
    """Each turn's tool_choice and reply: what a replay needs (the requests follow from them and the tools)."""
    return [[{"tool_choice": t.tool_choice, **t.reply} for t in e] for e in episodes]


# -- servers and their counters --------------------------------------------------------------------------
def start_server(bundle: Path, speculative: bool, chat_template: Path | None, log_dir: Path) -> LiveServer:
    """`specc serve BUNDLE` on a free loopback port, once /health answers."""
    args = ["--no-verify"] + ([] if speculative else ["--no-speculation"])
    args += ["--chat-template", str(chat_template)] if chat_template else []
    return LiveServer(bundle, log_dir / f"specc-serve-{bundle.name}.log", *args, name="agent", start_timeout=600)


def counters(url: str) -> dict[str, float]:
    """The server's Prometheus samples by name (unlabelled ones; a labelled sample keeps its labels in the name)."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def passes(before: dict, after: dict) -> dict:
    """Rounds, drafted and accepted tokens between two scrapes, and the tokens per target pass they give."""
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    rounds, accepted = delta("specc:spec_decode_k_count"), delta("specc:spec_decode_num_accepted_tokens_total")
    drafted = delta("specc:spec_decode_num_draft_tokens_total")
    return {"rounds": int(rounds), "drafted": int(drafted), "accepted": int(accepted),
            "tokens_per_target_pass": round((accepted + rounds) / rounds, 3) if rounds else None,
            "acceptance_rate": round(accepted / drafted, 3) if drafted else None}


# -- one system ------------------------------------------------------------------------------------------
WARMUP = ["Count from 1 to 20.", "Write a Python function that returns the square of a number."]


def serve_and_run(bundle: Path, speculative: bool, args, script: list[list[dict]] | None) -> tuple[list[list[Turn]], dict]:
    """Start a server, warm it up on texts outside the workload, run the episodes (live, or following the script),
    read its counters."""
    print(f"{bundle.name}{'' if speculative else ' (target-only)'}:", file=sys.stderr)
    server = start_server(bundle, speculative, args.chat_template, Path(args.log_dir))
    url = server.url
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=1800)
        for text in WARMUP[:args.warmup]:
            client.chat.completions.create(model="agent", messages=[{"role": "user", "content": text}],
                                           temperature=0, max_tokens=32)
        before = counters(url)
        episodes = [episode(client, "agent", i, TASKS[i % len(TASKS)], args.max_steps, args.max_tokens,
                            args.tool_choice, script[i] if script else None) for i in range(args.episodes)]
        after = counters(url)
    finally:
        server.close()
    return episodes, {**passes(before, after), **suffix_counters(after)}


def suffix_counters(after: dict) -> dict:
    """The suffix drafter's own figures where the bundle has one (hits over lookups, its rows' tokens per pass)."""
    if "specc:suffix_lookups" not in after:
        return {}
    lookups = after["specc:suffix_lookups"]
    return {"suffix_hit_rate": round(after["specc:suffix_hits"] / lookups, 3) if lookups else None,
            "suffix_tokens_per_pass": round(after["specc:suffix_tokens_per_pass"], 3)}


def summary(episodes: list[list[Turn]], script: list[list[dict]], stats: dict) -> dict:
    """tok/s over request time, tokens, turns, and the replies equal to the script's."""
    turns = [t for e in episodes for t in e]
    want = [{k: v for k, v in t.items() if k != "tool_choice"} for e in script for t in e]
    tokens, seconds = sum(t.completion_tokens for t in turns), sum(t.seconds for t in turns)
    equal = sum(a.reply == b for a, b in zip(turns, want))
    return {"tokens_per_second": round(tokens / seconds, 2), "tokens": tokens, "seconds": round(seconds, 3),
            "turns": len(turns), "outputs_equal": f"{equal}/{len(want)}",
            "prompt_tokens": sum(t.prompt_tokens for t in turns), "cached_tokens": sum(t.cached_tokens for t in turns),
            "seconds_by_episode": [round(sum(t.seconds for t in e), 3) for e in episodes], **stats}


def run(args) -> dict:
    """Target-only (live, or following --conversation), then each bundle on its turns; a docs/results file."""
    bundles = [Path(b) for b in args.bundles]
    script = json.loads(args.conversation.read_text())["conversation"] if args.conversation else None
    if script:
        args.episodes = len(script)
    episodes, stats = serve_and_run(bundles[0], False, args, script)
    script = script or conversation(episodes)
    systems = {"target-only": {**summary(episodes, script, stats), "speculative": False}}
    for bundle in bundles:
        episodes, stats = serve_and_run(bundle, True, args, script)
        systems[bundle.name] = {**summary(episodes, script, stats), "speculative": True}
    base = systems["target-only"]["tokens_per_second"]
    for name, s in systems.items():
        s["speedup_vs_reference"] = round(s["tokens_per_second"] / base, 3)
        print(f"{name}: {s}", file=sys.stderr)
    return result_file(args, script, systems)


def result_file(args, script: list[list[dict]], systems: dict) -> dict:
    """The run as a docs/results file (`specc report` renders it), with the conversation every system was sent."""
    from specc.hardware import cpu

    calls = [c[0] for e in script for t in e for c in t["calls"]]
    turns = sum(len(e) for e in script)
    return {
        "schema": "specc-results/1", "date": datetime.date.today().isoformat(), "provenance": "measured",
        "measured_by": "scripts/agent_bench.py", "machine": cpu(), "command": " ".join(["python", *sys.argv]),
        "prompt_set": f"scripts/agent_bench.py ({len(script)} episodes, tool_choice {args.tool_choice})",
        "prompts": turns, "prompt_kinds": {"agent turn": turns},
        "max_new_tokens": args.max_tokens, "batch_size": 1, "repeats": 1, "reference": "target-only",
        "steps_by_episode": [len(e) for e in script],
        "tool_calls": {name: calls.count(name) for name in sorted(set(calls))},
        "systems": systems, "conversation": script,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bundles", nargs="+", help="bundles of one target; the first also serves target-only")
    p.add_argument("--episodes", type=int, default=len(TASKS), help="episodes, cycling through the tasks")
    p.add_argument("--max-steps", type=int, default=8, help="most turns an episode takes (auto and required)")
    p.add_argument("--max-tokens", type=int, default=384, help="max_tokens of each turn")
    p.add_argument("--tool-choice", choices=("plan", "auto", "required"), default="plan",
                   help="plan: each step's tool named (list_files, read_file twice, search, write_file, run_tests), "
                        "then none; auto on every turn; or required until the tests pass, then none")
    p.add_argument("--conversation", type=Path, help="a results file of this script: every system, target-only "
                   "included, follows its conversation (a run measured again)")
    p.add_argument("--warmup", type=int, default=2, help="requests outside the workload before it (0 to 2)")
    p.add_argument("--chat-template", type=Path, help="passed to specc serve (a template that renders tools)")
    p.add_argument("--log-dir", default="/tmp", help="where each server's log goes")
    p.add_argument("--json", type=Path, help="write the results file here (else stdout)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    result = run(args)
    text = json.dumps(result, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    else:
        print(text)
    return result


if __name__ == "__main__":
    main()
