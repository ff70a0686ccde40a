"""`specc tune`: the speed-up model, measured costs on a tiny bundle, and editing the recipe's k."""
from __future__ import annotations

import json

import pytest
import yaml

from specc.cli import main
from specc.bench.tune import Acceptance, Costs, chain_tokens, predicted_speedup, round_cost, round_tokens

PROMPTS = "def add(a, b):\\n    return a + b\nabc abc abc abc abc\nhello world, hello world\n"


def geometric(alpha: float, k: int) -> list[float]:
    """The survival curve of a per-token acceptance alpha the same at every position."""
    return [alpha ** i for i in range(1, k + 1)]


def expected_tokens(alpha: float, k: int) -> float:
    """Leviathan et al.'s mean tokens of a round of k drafts at per-token acceptance alpha."""
    return float(k + 1) if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)


def test_speedup_model():
    costs = Costs(target_step=1.0, verify={1: 1.0, 2: 1.5}, draft_step=0.1, lookup=None)
    assert expected_tokens(0.0, 3) == 1.0 and expected_tokens(1.0, 3) == 4.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    # E(k) = 1 + s_1 + ... + s_k: the geometric formula where acceptance is the same at every position
    for alpha in (0.0, 0.3, 0.8, 1.0):
        assert chain_tokens(geometric(alpha, 4), 3) == pytest.approx(expected_tokens(alpha, 3))
    assert chain_tokens([0.5], 3) == 1.5  # positions the run never reached count 0
    assert predicted_speedup(Acceptance(geometric(0.5, 2)), 2, costs) == pytest.approx(1.75 / (0.2 + 1.5))
    assert predicted_speedup(Acceptance([1.0]), 1, costs) == pytest.approx(2 / 1.1)
    lookup = Costs(target_step=1.0, verify={2: 1.5}, draft_step=None, lookup=0.01)
    # half the rounds find no continuation: those are plain decode steps
    assert predicted_speedup(Acceptance(None, geometric(0.5, 2), 0.5), 2, lookup) == pytest.approx(
        (0.5 * 1.75 + 0.5) / (0.01 + 0.75 + 0.5))
    # lookup in front of a model: lookup drafts 40% of rounds, the model the rest (k drafts each); every round
    # pays the lookup and a verify pass
    both = Costs(target_step=1.0, verify={2: 1.5}, draft_step=0.1, lookup=0.01)
    acc = Acceptance(geometric(0.5, 2), geometric(0.8, 2), 0.4)
    assert round_tokens(acc, 2) == pytest.approx(0.4 * expected_tokens(0.8, 2) + 0.6 * 1.75)
    assert round_cost(2, both, acc) == pytest.approx(0.01 + 0.6 * 2 * 0.1 + 1.5)
    assert predicted_speedup(acc, 2, both) > predicted_speedup(Acceptance(geometric(0.5, 2)), 2, both)  # cheaper, better


def test_acceptance_of_a_run_splits_front_and_model_rounds():
    """Rounds of the drafter in front of a draft model (prompt lookup or the suffix drafter, `RoundRecord.front`)
    are one arm, the model's the other."""
    from specc.runtime.stats import RowStats

    run = RowStats()
    for n_draft, n_acc, by_front in [(3, 3, True), (3, 1, True), (3, 0, False), (3, 2, False), (3, 3, False)]:
        run.record(n_draft, n_acc, by_front)
    acc = Acceptance.of(run, has_model=True, has_lookup=True)
    assert acc.hit_rate == pytest.approx(2 / 5)
    assert acc.lookup == pytest.approx([1.0, 0.5, 0.5]) and acc.model == pytest.approx([2 / 3, 2 / 3, 1 / 3])
    assert acc.alpha_lookup == pytest.approx(4 / (4 + 1)) and acc.alpha_model == pytest.approx(5 / (5 + 2))
    assert Acceptance.of(run, has_model=True, has_lookup=False) == Acceptance([4 / 5, 3 / 5, 2 / 5], alpha_model=9 / 12)
    alone = RowStats()
    for n_draft, n_acc in [(2, 2), (0, 0), (2, 0), (0, 0)]:
        alone.record(n_draft, n_acc)
    assert Acceptance.of(alone, has_model=False, has_lookup=True) == Acceptance(None, [0.5, 0.5], 0.5, alpha_lookup=2 / 3)


def test_survival_predicts_a_run_the_pooled_alpha_overstates():
    """Half the rounds accept all 4 drafts, half none: alpha pooled over the run is 4/5, which the geometric
    model turns into 1.8 tokens a round at k=1, but a round of one draft yields 1.5; the survival curve says so."""
    from specc.runtime.stats import RowStats

    run = RowStats()
    for n_acc in (4, 0) * 10:
        run.record(4, n_acc)
    acc = Acceptance.of(run, has_model=True, has_lookup=False)
    assert acc.alpha_model == pytest.approx(0.8) and expected_tokens(0.8, 1) == pytest.approx(1.8)
    assert round_tokens(acc, 1) == pytest.approx(1.5) and round_tokens(acc, 4) == pytest.approx(3.0)


def test_tune_measures_predicts_and_writes_the_recipe(bundles, models_dir, tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text(PROMPTS)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"# my recipe\ntarget: {{model: {models_dir / 'target'}}}\n"
                      f"draft: {{method: model, model: {models_dir / 'draft'}}}   # the 2-layer draft\n"
                      "speculation:\n  mode: chain\n  k: 3   # draft tokens per round\n")
    out = tmp_path / "tune.json"
    assert main(["tune", str(bundles["draft"]), "--prompts", str(prompts), "--k-max", "4", "--max-new-tokens", "12",
                 "--repeats", "1", "--timing-prompts", "2", "--recipe", str(recipe), "--write", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    best = result["best_k"]
    assert 1 <= best <= 4 and set(result["predicted_speedup"]) == {"1", "2", "3", "4"}
    assert result["predicted_speedup"][str(best)] == max(result["predicted_speedup"].values())
    costs = result["costs"]
    assert costs["target_step"] > 0 and costs["draft_step"] > 0 and set(costs["verify"]) == {"1", "2", "3", "4"}
    assert 0 < result["alpha"] < 1  # a partly agreeing draft
    survival = result["survival_model"]  # full chains of 4: how far each round got, never rising along the chain
    assert len(survival) == 4 and all(a >= b for a, b in zip(survival, survival[1:])) and 0 < survival[0] < 1
    assert result["expected_tokens_per_round"][str(best)] == pytest.approx(1 + sum(survival[:best]))
    assert str(best) in result["measured"] and "3" in result["measured"]  # the best k and the recipe's, measured
    for m in result["measured"].values():
        assert m["speedup"] > 0 and m["tokens_per_target_pass"] >= 1
        # the measured speed-up is of decoding after prefill, as S(k) is
        assert m["speedup"] == pytest.approx(m["decode_tokens_per_second"] / result["target_only_decode_tokens_per_second"])
    captured = capsys.readouterr()
    printed = captured.out
    assert "speed-up pred." in printed and f"speculation.k 3 -> {best}" in printed
    # the progress bar: costs, the acceptance run's 2 prompts, then each check run
    assert "tune: " in captured.err and "check k=" in captured.err
    text = recipe.read_text()
    assert "# my recipe" in text and "# the 2-layer draft" in text and "# draft tokens per round" in text
    assert yaml.safe_load(text)["speculation"] == {"mode": "chain", "k": best}


def test_tune_prompt_lookup_uses_the_lookup_cost_and_hit_rate(bundles):
    import specc
    from specc.bench.tune import run_tune

    items = [{"prompt": "abc abc abc abc abc", "chat": False, "kind": ""},
             {"prompt": "x = 1\nx = 1\nx =", "chat": False, "kind": ""}]
    result = run_tune(specc.load(bundles["prompt_lookup"]), items, k_max=3, max_new_tokens=8, repeats=1, timing_prompts=1)
    costs = result["costs"]
    assert costs["draft_step"] is None and 0 <= costs["lookup"] < costs["target_step"]
    assert 0 < result["lookup_hit_rate"] <= 1 and result["best_k"] in (1, 2, 3)


def test_tune_lookup_in_front_of_a_model_prices_both_arms(bundles, prompts):
    import specc
    from specc.bench.tune import format_tune, run_tune

    items = [{"prompt": p, "chat": False, "kind": ""} for p in prompts[:12]]  # every third repeats itself
    model = specc.load(bundles["lookup_first"])
    assert model.draft_label == "model+lookup"
    result = run_tune(model, items, k_max=3, max_new_tokens=12, repeats=1, timing_prompts=1)
    costs = result["costs"]
    assert costs["draft_step"] > 0 and 0 <= costs["lookup"] < costs["target_step"]
    assert 0 < result["lookup_hit_rate"] < 1  # lookup drafts the repetitive prompt, the model the other
    assert 0 <= result["alpha_lookup"] <= 1 and 0 <= result["alpha_model"] <= 1
    assert result["best_k"] in (1, 2, 3) and set(result["measured"]) >= {1, result["best_k"]}
    assert "lookup rounds" in format_tune(result)


def test_tune_models_full_chains_and_measures_the_compiled_stops(bundles, monkeypatch):
    """alpha comes from chains that run to k (stop_below 0, as the model assumes); a bundle whose recipe stops
    chains early is measured as compiled too."""
    import specc
    from specc.bench.tune import format_tune, run_tune

    model = specc.load(bundles["draft"])
    monkeypatch.setattr(model, "stop_below", 0.9)
    items = [{"prompt": "def add(a, b):\n    return a + b", "chat": False, "kind": ""}]
    result = run_tune(model, items, k_max=3, max_new_tokens=12, repeats=1, timing_prompts=1, check_k=[3])
    compiled = result["measured_as_compiled"]
    assert compiled["k"] == model.k and compiled["stop_below"] == 0.9
    # the random tiny draft is never 90% sure: every compiled chain ends after its first draft
    assert compiled["tokens_per_target_pass"] <= 2.0 and result["measured"][3]["tokens_per_target_pass"] >= 1
    assert "as compiled" in format_tune(result)


def test_tune_measures_stop_thresholds_and_writes_the_fastest(bundles, models_dir, tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text(PROMPTS)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"target: {{model: {models_dir / 'target'}}}\n"
                      f"draft:\n  method: model\n  model: {models_dir / 'draft'}\nspeculation: {{k: 3}}\n")
    out = tmp_path / "tune.json"
    assert main(["tune", str(bundles["draft"]), "--prompts", str(prompts), "--k-max", "3", "--max-new-tokens", "12",
                 "--repeats", "1", "--timing-prompts", "1", "--stop-below", "0.3", "--stop-below", "0.9",
                 "--recipe", str(recipe), "--write", "--json", str(out), "--quiet"]) == 0
    captured = capsys.readouterr()
    assert "tune: " not in captured.err  # --quiet: no progress bar
    result = json.loads(out.read_text())
    best = result["best_k"]
    stops = result["measured_stop_below"]
    assert set(stops) == {"0.3", "0.9"} and str(best) in result["measured"]
    speedups = {0.0: result["measured"][str(best)]["speedup"], 0.3: stops["0.3"]["speedup"], 0.9: stops["0.9"]["speedup"]}
    assert result["best_stop_below"] == max(speedups, key=speedups.get)
    assert stops["0.9"]["tokens_per_target_pass"] <= 2.0  # the random draft is never 90% sure: chains of one
    assert "chains stop after a draft below p=0.9" in captured.out
    draft = yaml.safe_load(recipe.read_text())["draft"]
    assert draft["stop_below"] == result["best_stop_below"] and yaml.safe_load(recipe.read_text())["speculation"]["k"] == best


def test_tune_refuses_a_recipe_of_another_bundle(bundles, models_dir, tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text(PROMPTS)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"target: {{model: {models_dir / 'target'}}}\ndraft: {{method: prompt_lookup}}\n")
    assert main(["tune", str(bundles["draft"]), "--prompts", str(prompts), "--recipe", str(recipe), "--write"]) == 2
    assert "the bundle was compiled from" in capsys.readouterr().err
    assert main(["tune", str(bundles["tree_static"]), "--prompts", str(prompts)]) == 2
    assert "speculation.mode tree" in capsys.readouterr().err
    assert main(["tune", str(bundles["draft"]), "--prompts", str(prompts), "--write"]) == 2
    assert main(["tune", str(bundles["draft"]), "--prompts", str(prompts), "--max-new-tokens", "1"]) == 2
    assert "--max-new-tokens must be >= 2" in capsys.readouterr().err
    assert main(["tune", str(bundles["prompt_lookup"]), "--prompts", str(prompts), "--stop-below", "0.5"]) == 2
    assert "drafters of one token at a time" in capsys.readouterr().err
    assert main(["tune", str(bundles["draft"]), "--prompts", str(prompts), "--stop-below", "1.5"]) == 2
    assert "--stop-below 1.5: allowed a probability in [0, 1]" in capsys.readouterr().err
