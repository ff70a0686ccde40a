"""scripts/agent_bench.py end to end on the tiny bundles: `specc serve` started per system, the scripted agent's
episodes run on target-only and replayed on suffix decoding, every reply equal, and the
results file renders as docs/results files do."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from specc.bench.results import load, table
from test_tools import HERMES

pytest.importorskip("fastapi")
ROOT = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("agent_bench", ROOT / "scripts" / "agent_bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script loads
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def suffix_bundle(models_dir, tmp_path_factory) -> Path:
    """The tiny target drafted by suffix decoding, with room for an episode's conversation."""
    from conftest import build_bundle, built_once

    return built_once(tmp_path_factory, "bundles/agent_suffix", lambda out: build_bundle(
        out, models_dir / "target", {"method": "suffix"}, limits={"max_batch": 4, "max_context": 4096}))


def test_the_agent_workload_runs_through_specc_serve_and_every_reply_equals_target_only(suffix_bundle, tmp_path):
    bench = _script()
    template = tmp_path / "hermes.jinja"
    template.write_text(HERMES)
    out = tmp_path / "agent.json"
    result = bench.main([str(suffix_bundle), "--episodes", "2", "--max-tokens", "96", "--warmup", "1",
                         "--chat-template", str(template), "--log-dir", str(tmp_path), "--json", str(out)])
    assert result["steps_by_episode"] == [7, 7]  # six turns that name their tool, then one in text
    assert result["tool_calls"] == {"list_files": 2, "read_file": 4, "run_tests": 2, "search": 2, "write_file": 2}
    systems = result["systems"]
    assert list(systems) == ["target-only", "agent_suffix"]
    for name, s in systems.items():
        assert s["outputs_equal"] == "14/14", name
        assert s["turns"] == 14 and s["tokens"] > 0
    assert systems["target-only"]["drafted"] == 0
    assert systems["agent_suffix"]["tokens_per_target_pass"] >= 1.0 and systems["agent_suffix"]["rounds"] > 0
    assert "suffix_hit_rate" in systems["agent_suffix"] and "suffix_hit_rate" not in systems["target-only"]
    run = load(out)
    assert "| agent_suffix |" in table(run) and "14/14" in table(run)


def test_the_tools_answer_from_the_workspace_deterministically():
    bench = _script()
    task = bench.TASKS[1]
    work = bench.Workspace(task)
    assert "inventory/money.py" in work.call("list_files", "{}").splitlines()
    assert work.call("read_file", '{"path": "nope.py"}') == "error: no file nope.py"
    assert work.call("search", '{"text": "fmt_price"}').startswith("inventory/money.py:4: def fmt_price")
    assert work.call("run_tests", '{"path": "tests/test_money.py"}').startswith("FAILED tests/test_money.py")
    fixed = bench.REPO["inventory/money.py"].replace("fmt_price", "format_price")
    work.call("write_file", json.dumps(dict(path="inventory/money.py", content=fixed)))
    assert work.call("run_tests", "{}") == "6 passed"
    assert work.call("write_file", '{"path": "a.py", "cont').startswith("error: the call was cut short")
    assert work.call("read_file", '{"file": "a.py"}') == "error: bad arguments for read_file"
