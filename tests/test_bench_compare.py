"""`specc bench --compare hf` end to end on tiny bundles, and how results report equality."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from specc.bench.run import SPECC_TARGET_ONLY, compare_tokens, load_bundles, specc_systems, summarise, target_build
from specc.bench.hf import HFSystem
from specc.bench.report import summary_table
from specc.cli import main

PROMPTS = ('{"prompt": "def f(x):\\n    return x + x", "kind": "code"}\n'
           '{"prompt": "abc abc abc abc", "kind": "code"}\n'
           '{"prompt": "hello there", "chat": true, "kind": "chat"}\n')


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(PROMPTS)
    return path


def _bench(bundle, prompts, out, *extra) -> dict:
    assert main(["bench", str(bundle), "--prompts", str(prompts), "--max-new-tokens", "12", "--compare", "hf",
                 "--json", str(out), *extra]) == 0
    return json.loads(out.read_text())


def test_compare_hf_with_a_draft_model(bundles, prompts, tmp_path, capsys):
    result = _bench(bundles["draft"], prompts, tmp_path / "out" / "bench.json", "--k", "2")
    systems = result["systems"]
    assert list(systems) == ["hf target-only", "hf assisted [draft] default", "hf assisted [draft] k=2",
                             "hf prompt lookup k=2", "specc target-only", "draft [model] chain k=2"]
    assert result["reference"] == "hf target-only" and result["skipped"] == []
    for name, s in systems.items():  # every greedy output is the HF target's, token for token
        assert s["equality"] == {"equal": 3, "prefix": 0, "differs": 0, "of": 3}, name
        assert len(s["per_prompt"]) == 3 and all(p["tokens_per_second"] > 0 for p in s["per_prompt"])
        assert s["tokens_per_second_by_kind"].keys() == {"code", "chat"}
    reasons = [p["finish_reason"] for p in systems["hf target-only"]["per_prompt"]]
    assert set(reasons) <= {"stop", "length"}
    assert all([p["finish_reason"] for p in s["per_prompt"]] == reasons for s in systems.values())
    assert systems["hf target-only"]["speedup_vs_reference"] == 1.0
    constant = systems["hf assisted [draft] k=2"]
    assert constant["settings"]["num_assistant_tokens"] == 2 and constant["settings"]["assistant_confidence_threshold"] == 0
    assert constant["drafted"] > 0 and len(constant["acceptance_by_position"]) == 2  # recorded per round from transformers
    assert 0 < constant["per_token_acceptance"] < 1
    assert systems["hf assisted [draft] default"]["settings"]["num_assistant_tokens_schedule"] in ("constant", "heuristic")
    best = max((n for n in systems if n.startswith("hf ") and n != "hf target-only"),
               key=lambda n: systems[n]["tokens_per_second"])
    assert systems[best]["speedup_vs_best_hf_speculative"] == 1.0
    md = (tmp_path / "out" / "bench.md").read_text()
    assert all(name in md for name in systems) and "## Acceptance by draft position" in md and "bench.png" in md
    png = tmp_path / "out" / "bench.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and result["plot"] == str(png)
    assert "vs best hf spec." in capsys.readouterr().out


def test_compare_hf_with_prompt_lookup_skips_assisted(bundles, prompts, tmp_path, capsys):
    result = _bench(bundles["prompt_lookup"], prompts, tmp_path / "pl.json")
    assert list(result["systems"]) == ["hf target-only", "hf prompt lookup k=3", "specc target-only",
                                       "prompt_lookup [prompt_lookup] chain k=3"]
    lookup = result["systems"]["hf prompt lookup k=3"]
    assert lookup["settings"]["max_matching_ngram_size"] == 2  # the bundle's draft.max_ngram
    assert all(s["outputs_equal"] == "3/3" for s in result["systems"].values())
    assert [s["system"] for s in result["skipped"]] == ["hf assisted"] and "no draft model" in result["skipped"][0]["reason"]
    out = capsys.readouterr().out
    assert "hf assisted (prompt_lookup)" in out and "skipped: draft.method prompt_lookup" in out
    assert "skipped: draft.method prompt_lookup" in (tmp_path / "pl.md").read_text()


def test_compare_hf_needs_batch_one(bundles, prompts, capsys):
    assert main(["bench", str(bundles["draft"]), "--prompts", str(prompts), "--compare", "hf", "--max-batch", "2"]) == 2
    assert "specc: error: --compare hf measures batch 1" in capsys.readouterr().err


def test_bundles_of_one_target_share_its_engine(bundles):
    draft, lookup, early_exit = load_bundles([bundles["draft"], bundles["prompt_lookup"], bundles["early_exit"]])
    assert draft.target.step.runner is lookup.target.step.runner is early_exit.target.step.runner
    assert draft.drafter.step.runner is not draft.target.step.runner
    assert early_exit.drafter.step.runner is not draft.drafter.step.runner


def test_a_target_compiled_differently_is_its_own_reference(bundles):
    """A bundle on another backend (or quantisation) has other target-only outputs: it gets a target-only
    system of its own, which its speculative systems are compared with."""
    draft, lookup, wrong = load_bundles([bundles["draft"], bundles["prompt_lookup"], bundles["wrong"]])
    systems = {s.name: s for s in specc_systems([draft, lookup, wrong], [2], [])}
    own = f"{SPECC_TARGET_ONLY} [{wrong.bundle.path.name}]"
    assert [n for n in systems if "target-only" in n] == [SPECC_TARGET_ONLY, own]  # draft and lookup share one
    assert systems[own].model is wrong and systems[own].reference == own
    refs = {n: s.reference for n, s in systems.items() if s.speculative}
    assert refs[f"{wrong.bundle.path.name} [{wrong.draft_label}] chain k=2"] == own
    assert [r for n, r in refs.items() if not n.startswith(wrong.bundle.path.name)] == [None, None]


def test_a_target_attending_another_way_is_another_build(bundles):
    """A quantised chain graph on the CacheAttention kernel and a tree graph attending in float64 give other
    near-ties: the bench must not compare one's outputs with the other's target-only."""
    (draft,) = load_bundles([bundles["draft"]])
    manifest = copy.deepcopy(draft.bundle.manifest)
    plain = target_build(manifest)
    manifest.graph("target").facts["weight_quant"] = {"attention_in_kernel": 28}
    in_kernel = target_build(manifest)
    manifest.graph("target").facts["weight_quant"] = {"attention_float64": 28}
    assert len({plain, in_kernel, target_build(manifest)}) == 3 and "attention_float64 28" in target_build(manifest)


def test_stop_below_measures_each_chain_at_each_threshold(bundles, prompts, tmp_path, capsys):
    """--stop-below P: every integer-k chain of a drafter that can stop early, once per P; at 1 every chain
    ends after its first draft, at 0 none ends early; lookup (no probabilities) keeps its one chain."""
    out = tmp_path / "stops.json"
    assert main(["bench", str(bundles["draft"]), str(bundles["prompt_lookup"]), "--prompts", str(prompts),
                 "--max-new-tokens", "12", "--k", "2", "--stop-below", "0", "--stop-below", "1", "--json", str(out)]) == 0
    systems = json.loads(out.read_text())["systems"]
    assert list(systems) == [SPECC_TARGET_ONLY, "draft [model] chain k=2 stop<0", "draft [model] chain k=2 stop<1",
                             "prompt_lookup [prompt_lookup] chain k=2"]
    never, always = systems["draft [model] chain k=2 stop<0"], systems["draft [model] chain k=2 stop<1"]
    assert never["settings"]["stop_below"] == 0 and always["settings"]["stop_below"] == 1
    assert all(s["equality"]["differs"] == 0 for s in systems.values())
    assert always["drafted"] == always["rounds"] and never["drafted"] > never["rounds"]
    (draft,) = load_bundles([bundles["draft"]])
    names = [s.name for s in specc_systems([draft], ["auto", 2], [], stop_below=[0.3])]
    assert names[1:] == ["draft [model] chain k=auto", "draft [model] chain k=2 stop<0.3"]  # auto sets its own
    assert main(["bench", str(bundles["draft"]), "--prompts", str(prompts), "--stop-below", "1.5"]) == 2
    assert "--stop-below 1.5: allowed a probability in [0, 1]" in capsys.readouterr().err


class _FixedModel:
    """Stands in for a transformers model: generate returns the prompt and then fixed tokens."""

    device = "cpu"

    def __init__(self, new):
        self.new = new

    def generate(self, x, **kwargs):
        return torch.cat([x, torch.tensor([self.new])], dim=1)


def test_hf_output_ends_before_eos_like_specc():
    system = HFSystem("hf target-only", _FixedModel([5, 6, 256, 7]), eos_ids=[256])
    tokens, reason, seconds, stats = system.generate([1, 2, 3], max_new_tokens=4)
    assert tokens == [5, 6] and reason == "stop" and seconds > 0 and stats.rounds == 0
    assert HFSystem("x", _FixedModel([5, 6]), eos_ids=[256]).generate([1], 2)[:2] == ([5, 6], "length")


def test_compare_tokens():
    assert compare_tokens([1, 2, 3], [1, 2, 3]) == ("equal", None)
    assert compare_tokens([1, 2], [1, 2, 3]) == ("prefix", 2)
    assert compare_tokens([1, 9, 3], [1, 2, 3]) == ("differs", 1)


class _Fake:
    def __init__(self, name, family, speculative):
        self.name, self.family, self.speculative, self.settings = name, family, speculative, {}


def _run(tokens, seconds):
    per_prompt = [{"prompt": i, "new_tokens": len(t), "seconds": seconds, "tokens_per_second": len(t) / seconds}
                  for i, t in enumerate(tokens)]
    n = sum(len(t) for t in tokens)
    summary = {"tokens_per_second": n / (seconds * len(tokens)), "acceptance_rate": None, "per_token_acceptance": None,
               "tokens_per_target_pass": None, "prefill_seconds": None, "draft_seconds": None, "target_seconds": None,
               "host_seconds": None}
    return {"summary": summary, "tokens": tokens, "per_prompt": per_prompt}


def test_a_different_output_is_counted_and_shown():
    systems = [_Fake("ref", "hf", False), _Fake("ok", "specc", True), _Fake("bad", "specc", True)]
    ref = [[1, 2, 3], [4, 5, 6]]
    runs = {"ref": [_run(ref, 1.0)], "ok": [_run(ref, 0.5)],
            "bad": [_run([[1, 2, 3], [4, 7, 6]], 0.5), _run([[1, 2, 3], [4, 5]], 0.6), _run([[1, 2, 3], [4, 7, 6]], 0.4)]}
    items = [{"kind": "code"}, {"kind": "chat"}]
    out = summarise(systems, runs, items)
    assert out["ok"]["equality"] == {"equal": 2, "prefix": 0, "differs": 0, "of": 2} and out["ok"]["speedup_vs_reference"] == 2.0
    assert out["bad"]["equality"]["differs"] == 1 and out["bad"]["outputs_equal"] == "1/2"  # the median repeat
    assert out["bad"]["per_prompt"][1]["first_difference"] == 1
    assert out["bad"]["per_prompt"][1]["tokens"] == [4, 7, 6] and out["bad"]["per_prompt"][1]["reference_tokens"] == [4, 5, 6]
    results = {"reference": "ref", "compare": "hf", "systems": out, "skipped": []}
    table = summary_table(results)
    assert "OUTPUT DIFFERS on 1 prompt(s), first at token 1" in table


def test_bandwidth_lines_use_each_bundles_own_target_bytes(monkeypatch):
    """Two bundles with differently quantised targets in one run: each system's line reads its bundle's bytes."""
    from types import SimpleNamespace

    from specc.bench import bandwidth, llamacpp

    def bundle(path, nbytes):
        graph = SimpleNamespace(facts={"weight_quant": {"weight_bytes": nbytes}})
        return SimpleNamespace(bundle=SimpleNamespace(path=path, graph=lambda role: graph))

    from specc import kernels

    monkeypatch.setattr(bandwidth, "copy_bandwidth", lambda threads=None: 20.0)
    monkeypatch.setattr(bandwidth, "linear_macs_per_row", lambda b: {"/b/a": 10**9, "/b/b": 2 * 10**9}[str(b.path)])
    monkeypatch.setattr(kernels, "dot_peak", lambda isa=None, threads=1: 400.0)
    monkeypatch.setattr(llamacpp, "goal_lines", lambda results: [])
    systems = {name: {"family": "specc", "settings": {"bundle": b}, "tokens_per_second": 10.0, "speculative": spec,
                      "tokens_per_target_pass": 2.0 if spec else None, "target_seconds": 5.0, "rounds": 30,
                      "drafted": 70, "new_tokens": 52, "requests": 2}
               for name, b, spec in [("a only", "/b/a", False), ("b only", "/b/b", False), ("b spec", "/b/b", True)]}
    results = {"systems": systems}
    llamacpp.annotate(results, [bundle("/b/a", 1_000_000_000), bundle("/b/b", 2_000_000_000)], {})
    assert [systems[n]["weight_bytes_per_pass"] for n in ("a only", "b only", "b spec")] == [1e9, 2e9, 2e9]
    assert systems["b spec"]["weight_gb_per_second"] == 2.0 * 5.0
    # decoding alone (target-only): 50 one-token passes in the target's 5 s, the prefill left out
    assert systems["a only"]["decode_weight_gb_per_second"] == 1.0 * 50 / 5.0
    assert "decode_weight_gb_per_second" not in systems["b spec"]
    assert any("decoding alone: 10.00 passes/s = 10.00 GB/s (50% of the copy bandwidth)" in line
               for line in results["bandwidth_lines"])
    if kernels.available():  # MACs in target passes: rows verified (rounds + drafts; target-only, tokens after the
        # first) x MACs per row, over the target's seconds, against the dot peak
        assert systems["a only"]["target_gmac_per_second"] == 1.0 * 50 / 5.0
        assert systems["b spec"]["target_gmac_per_second"] == 2.0 * 100 / 5.0
        assert any("40 GMAC/s (10% of the peak)" in line for line in results["bandwidth_lines"])


class _Clocked:
    """A fake system whose speed is the machine's at the moment it runs: the log says when each one ran."""

    def __init__(self, name: str, log: list, with_stats: bool):
        self.name, self.log, self.with_stats, self.begun = name, log, with_stats, 0

    def begin(self):
        self.begun += 1

    def run(self, prompts, max_new_tokens):
        from specc.runtime.stats import RunStats

        self.log.append((self.name, tuple(map(tuple, prompts))))
        slow = 1.0 + len(self.log) / 10  # the machine slows down as the run goes on
        tokens = [list(p) * 2 for p in prompts]
        n = sum(map(len, tokens))
        per_prompt = [{"prompt": i, "new_tokens": len(t), "seconds": slow} for i, t in enumerate(tokens)]
        summary = {"requests": len(prompts), "new_tokens": n, "seconds": slow * len(prompts), "tokens_per_second": None,
                   "prefill_seconds": 0.5, "draft_seconds": None, "target_seconds": None, "host_seconds": None}
        out = {"summary": summary, "tokens": tokens, "per_prompt": per_prompt}
        if self.with_stats:
            out["stats"] = RunStats(requests=len(prompts), new_tokens=n, seconds=slow * len(prompts))
        return out


def test_systems_take_turns_prompt_by_prompt_and_each_run_adds_up():
    """Systems alternate batch by batch, so a machine that slows during the run slows all of them alike; each
    system's run holds every prompt in order, its figures added up over the batches."""
    from specc.bench.run import take_turns

    log = []
    a, b = _Clocked("a", log, with_stats=True), _Clocked("b", log, with_stats=False)
    prompts = [[1], [2, 2], [3], [4, 4, 4], [5]]
    runs = take_turns([a, b], prompts, 8, repeats=2, batch_size=2)
    assert [name for name, _ in log] == ["a", "b"] * 6 and a.begun == b.begun == 2
    assert [p for name, p in log[:6] if name == "a"] == [((1,), (2, 2)), ((3,), (4, 4, 4)), ((5,),)]
    for name in ("a", "b"):
        assert len(runs[name]) == 2
        run = runs[name][0]
        assert run["tokens"] == [p * 2 for p in prompts] and "stats" not in run
        assert [p["prompt"] for p in run["per_prompt"]] == [0, 1, 2, 3, 4]
        assert run["summary"]["requests"] == 5 and run["summary"]["new_tokens"] == 16
    # both systems met the same slowdown: equal speed, though b ran each batch just after a
    first_a, first_b = runs["a"][0]["summary"], runs["b"][0]["summary"]
    assert abs(first_a["seconds"] - first_b["seconds"]) <= 0.1 * 3 * 2
    assert first_b["prefill_seconds"] == 1.5 and first_b["draft_seconds"] is None
    assert first_b["tokens_per_second"] == 16 / first_b["seconds"]
