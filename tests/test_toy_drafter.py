"""Adding a drafter is its class and one row of the method table: a toy drafter registered here alone
compiles into a bundle through the normal path, loads, drafts and stays lossless."""
from __future__ import annotations

import pytest
import torch

import specc
from conftest import build_bundle
from specc.errors import RecipeError, SpeccError
from specc.methods import METHODS, DraftMethod, register_method
from specc.recipe import parse_recipe
from specc.runtime.drafters import DraftContext, DraftPlan, Drafter, Proposal
from specc.runtime.state import Batch
from specc.speculation.sampling import RowParams


class RepeatDrafter(Drafter):
    """Drafts each row's last token k times: no graph, no state."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.proposed = 0

    @classmethod
    def build(cls, ctx: DraftContext) -> "RepeatDrafter":
        return cls(ctx.vocab_size)

    def propose(self, batch: Batch, params: RowParams, plan: DraftPlan) -> Proposal:
        tokens = batch.pending[:, None].repeat(1, plan.k)
        q = None
        if not params.all_greedy:  # one-hot: the draft was certain of its token
            q = torch.zeros(*tokens.shape, self.vocab_size).scatter_(-1, tokens[..., None], 1.0)
        self.proposed += tokens.numel()
        return Proposal(tokens, q, torch.full_like(batch.pending, plan.k))


TOY = DraftMethod("toy", None, RepeatDrafter)


@pytest.fixture(scope="module")
def toy(models_dir, tmp_path_factory):
    """The toy method registered for this module's tests (and removed after), and a bundle compiled with it."""
    before = METHODS.get("toy")
    register_method(TOY)
    try:
        yield build_bundle(tmp_path_factory.mktemp("toy") / "bundle", models_dir / "target", {"method": "toy"},
                           speculation={"k": 3})
    finally:
        METHODS.pop("toy")
        if before is not None:
            METHODS["toy"] = before


def test_a_toy_drafter_compiles_and_runs_losslessly(toy, prompts):
    """Greedy output equals target-only output over several prompts, and the toy drafted (and had some
    of its repeats accepted) along the way."""
    model = specc.load(toy)
    assert isinstance(model.drafter, RepeatDrafter) and model.drafter.method is TOY
    assert model.bundle.manifest.draft.method == "toy" and model.bundle.manifest.draft.graph is None
    chunk = prompts[:12]
    fast = model.generate(chunk, max_new_tokens=16, k=3)
    stats = fast.stats.to_dict()
    slow = model.generate(chunk, max_new_tokens=16, speculative=False)
    assert [c.token_ids for c in fast] == [c.token_ids for c in slow]
    assert stats["rounds"] > 0 and stats["drafted"] == model.drafter.proposed > 0 and stats["accepted"] > 0
    assert all(c.stats["drafted"] > 0 for c in fast)


def test_a_toy_drafter_runs_sampled_rows(toy, prompts):
    """Sampled rows draft with one-hot q; a fixed seed gives the same output twice."""
    model = specc.load(toy)
    one = model.generate(prompts[:4], max_new_tokens=8, temperature=0.9, seed=3)
    two = model.generate(prompts[:4], max_new_tokens=8, temperature=0.9, seed=3)
    assert [c.token_ids for c in one] == [c.token_ids for c in two] and one.stats.speculation.drafted > 0


def test_the_recipe_reads_the_toys_capabilities(toy, models_dir):
    """What the row does not declare (trees, early stops, lookup in front, a draft model) the recipe refuses."""
    base = {"target": {"model": str(models_dir / "target")}, "draft": {"method": "toy"}}
    assert parse_recipe(base).draft.method == "toy"
    refused = {
        "speculation.mode": {**base, "speculation": {"mode": "tree"}},
        "draft.stop_below": {**base, "draft": {"method": "toy", "stop_below": 0.3}},
        "draft.lookup": {**base, "draft": {"method": "toy", "lookup": True}},
        "draft.model": {**base, "draft": {"method": "toy", "model": "m"}},
    }
    for field, recipe in refused.items():
        with pytest.raises(RecipeError, match=field.replace(".", r"\.")):
            parse_recipe(recipe)


def test_the_hf_baselines_read_the_toys_capabilities(toy, monkeypatch):
    """`specc bench --compare hf` reads the row, not the name: no draft model, so no assisted system and a
    note saying why; declared a prompt lookup (`ngram_lookup`), its recipe's draft.max_ngram sizes the hf
    prompt lookup system's n-grams and the note points there."""
    from dataclasses import replace

    from specc.bench.hf import hf_systems

    model = specc.load(toy)
    systems, skipped = hf_systems([model], [2], model.tokenizer)
    assert [s.name for s in systems] == ["hf target-only", "hf prompt lookup k=2"]
    assert skipped == [{"system": "hf assisted", "bundle": toy.name, "reason": "draft.method toy: no draft model"}]
    assert systems[1].kwargs["max_matching_ngram_size"] == 2  # transformers' default: no prompt-lookup bundle
    monkeypatch.setitem(METHODS, "toy", replace(TOY, ngram_lookup=True))
    systems, skipped = hf_systems([model], [2], model.tokenizer)
    assert systems[1].kwargs["max_matching_ngram_size"] == model.bundle.recipe.draft.max_ngram == 3
    assert skipped[0]["reason"].endswith("the comparable Hugging Face system is hf prompt lookup")


def test_without_its_row_the_toy_bundle_is_refused(toy, monkeypatch):
    """A bundle whose draft method this specc does not know fails to load with an error naming it."""
    monkeypatch.delitem(METHODS, "toy")
    with pytest.raises(SpeccError, match="toy"):
        specc.load(toy)
    with pytest.raises(RecipeError, match="draft.method"):
        parse_recipe({"target": {"model": "m"}, "draft": {"method": "toy"}})
