"""Greedy speculation must reproduce target-only greedy output token for token."""
from __future__ import annotations

import pytest

import specc


_REFERENCE: dict[tuple[str, tuple[str, ...]], list[list[int]]] = {}


def _target_only(model, prompts) -> list[list[int]]:
    """Target-only greedy output of every prompt, computed once per bundle and prompt list (one row at a time)."""
    key = (str(model.bundle.path), tuple(prompts))
    if key not in _REFERENCE:
        _REFERENCE[key] = [c.token_ids for p in prompts for c in model.generate([p], max_new_tokens=20, speculative=False)]
    return _REFERENCE[key]


def _mismatches(model, prompts, batch, **spec):
    """Indices of prompts whose speculative output differs from target-only; also the speculative stats."""
    from specc.runtime.stats import RunStats

    spec = spec if model.tree is None else {}  # trees draft the recipe's shape
    reference = _target_only(model, prompts)
    bad, stats = [], RunStats()
    for lo in range(0, len(prompts), batch):
        fast = model.generate(prompts[lo:lo + batch], max_new_tokens=20, **spec)
        stats.merge(model.last_stats)
        bad += [lo + i for i, c in enumerate(fast) if c.token_ids != reference[lo + i]]
    return bad, stats.to_dict()


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_real_draft_matches_target_only(bundles, prompts, batch, k):
    model = specc.load(bundles["draft"])
    assert len(prompts) >= 50
    bad, stats = _mismatches(model, prompts, batch, k=k)
    assert bad == []
    assert stats["rounds"] > 0 and 0 < stats["acceptance_rate"] < 1


@pytest.mark.parametrize("name, batch", [("tree_dynamic", 1), ("tree_dynamic", 4), ("tree_static", 4),
                                         ("early_exit", 1), ("early_exit", 4), ("early_exit_tree", 4),
                                         ("prompt_lookup", 4), ("lookup_first", 1), ("lookup_first", 3)])
def test_other_drafters_match_target_only(bundles, prompts, name, batch):
    model = specc.load(bundles[name])
    bad, stats = _mismatches(model, prompts, batch)
    assert bad == []
    assert 0 < stats["acceptance_rate"] < 1


@pytest.mark.parametrize("name", ["wrong", "tree_wrong"])
def test_always_wrong_draft_accepts_nothing_and_still_matches(bundles, prompts, name):
    model = specc.load(bundles[name])
    bad, stats = _mismatches(model, prompts, 4, k=3)
    assert bad == []
    assert stats["drafted"] > 0 and stats["accepted"] == 0
    assert stats["tokens_per_target_pass"] == 1.0


@pytest.mark.parametrize("name", ["self", "tree_self"])
def test_draft_equal_to_target_accepts_everything(bundles, prompts, name, whole_draft_context):
    model = specc.load(bundles[name])
    bad, stats = _mismatches(model, prompts, 4, k=4)
    assert bad == []
    assert stats["acceptance_rate"] == 1.0


def test_lookup_first_uses_both_drafters(bundles, prompts):
    """draft.lookup: lookup drafts the rounds where it finds a continuation, the model the others."""
    model = specc.load(bundles["lookup_first"])
    _, stats = _mismatches(model, prompts, 1)
    assert 0 < stats["front_rounds"] < stats["rounds"]
    assert stats["front_acceptance_rate"] is not None and stats["model_acceptance_rate"] is not None


@pytest.mark.parametrize("batch", [1, 3])
def test_lookup_first_keeps_the_model_cache_in_step(bundles, prompts, batch, whole_draft_context):
    """Draft = target behind prompt lookup: every model round must accept all its drafts, which only
    holds if the draft cache catches up on the tokens that lookup rounds committed."""
    from specc.runtime.drafters import FrontDrafter, PromptLookupDrafter
    from specc.runtime.drafters.base import with_method

    model = specc.load(bundles["self"])
    lookup = with_method(PromptLookupDrafter(2, 1, model.target.dims.vocab_size), "prompt_lookup")
    model.drafter = FrontDrafter(lookup, model.drafter)
    bad, stats = _mismatches(model, prompts, batch, k=3)
    assert bad == []
    assert 0 < stats["front_rounds"] < stats["rounds"] and stats["front_acceptance_rate"] < 1
    assert stats["model_acceptance_rate"] == 1.0


def test_rows_advance_by_different_amounts(bundles, prompts):
    """In one batch, rows accept different numbers of drafts per round and still match."""
    model = specc.load(bundles["draft"])
    outs = model.generate(prompts[:4], max_new_tokens=20, k=4)
    assert len({c.stats["accepted"] for c in outs}) > 1, "test needs rows with different acceptance"
    assert [c.token_ids for c in outs] == _target_only(model, prompts)[:4]


def test_speculation_matches_hugging_face_greedy(bundles, models_dir, prompts):
    """The compiled target-only path itself equals Hugging Face generate (so 'lossless' means lossless w.r.t. HF)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(models_dir / "target").eval()
    tok = AutoTokenizer.from_pretrained(models_dir / "target")
    model = specc.load(bundles["draft"])
    for prompt in prompts[:10]:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=256)[0, ids.shape[1]:]
        got = model.generate([prompt], max_new_tokens=16, k=3)[0].token_ids
        ref = [t for t in ref.tolist()]
        assert got == ref[: len(got)] and (len(got) == 16 or ref[len(got)] == 256)


@pytest.mark.parametrize("name", ["draft", "lookup_first", "early_exit"])
def test_early_stops_match_target_only(bundles, prompts, name):
    """draft.stop_below: a row's chain ends after a draft the draft model gave < 0.5; the others run on
    (batch 3), and the draft model's cache stays in step with the target's whatever length each row drafted."""
    model = specc.load(bundles[name])
    bad, stats = _mismatches(model, prompts, 3, k=4, stop_below=0.5)
    assert bad == []
    drafted_rounds = stats["rounds"] - stats["front_rounds"]
    assert stats["rounds"] < stats["drafted"] < 4 * drafted_rounds + 4 * stats["front_rounds"], "some chains stop early"


@pytest.mark.parametrize("name, batch", [("draft", 3), ("lookup_first", 3), ("tree_dynamic", 2)])
def test_a_draft_that_takes_in_only_the_last_tokens_still_matches(bundles, prompts, name, batch, monkeypatch):
    """A draft model's cache takes in a long prompt's first DRAFT_SINK and last DRAFT_WINDOW tokens only (here
    2 and 6, shorter than most prompts): drafts from a shorter context change what is proposed, never what is kept."""
    from specc.runtime.drafters import model as model_drafter

    monkeypatch.setattr(model_drafter, "DRAFT_WINDOW", 6)
    monkeypatch.setattr(model_drafter, "DRAFT_SINK", 2)
    model = specc.load(bundles[name])
    bad, stats = _mismatches(model, prompts, batch, k=3)  # all prompts: the target-only reference is per list
    assert bad == []
    assert stats["drafted"] > 0


def test_the_draft_cache_holds_the_window_and_stays_in_step(bundles, prompts, monkeypatch):
    """Draft = target with a sink and a window: the draft sees less context, so it is no longer always right; its
    cache holds the sink, the window and what was generated, and rows keep matching target-only."""
    from specc.runtime.drafters import model as model_drafter

    monkeypatch.setattr(model_drafter, "DRAFT_WINDOW", 6)
    monkeypatch.setattr(model_drafter, "DRAFT_SINK", 3)
    model = specc.load(bundles["self"])
    seen = []
    catch_up = model_drafter.ModelDrafter.catch_up

    def watched(self, batch, warm=True):
        out = catch_up(self, batch, warm)
        seen.extend((len(s.tokens), s.draft_memo.get(model_drafter.SKIPPED, 0), n)
                    for s, n in zip(batch.seqs, batch.draft_state.lengths.tolist()))
        return out

    monkeypatch.setattr(model_drafter.ModelDrafter, "catch_up", watched)
    bad, _ = _mismatches(model, prompts, 3, k=3)
    assert bad == []
    assert seen and all(skip + n <= tokens for tokens, skip, n in seen)
    assert any(skip > 0 for _, skip, _ in seen) and all(n <= 3 + 6 + 20 + 4 for _, _, n in seen)


def test_a_short_answer_takes_in_a_shorter_window(bundles, prompts, monkeypatch):
    """The window shrinks to WINDOW_PER_NEW_TOKEN per token a row may still generate (never below
    DRAFT_WINDOW_MIN): a 20-token answer at 1 per token enters only its prompt's first DRAFT_SINK tokens and its
    last 20, the catch-up it can pay back, and output still matches target-only."""
    from specc.runtime.drafters import model as model_drafter

    monkeypatch.setattr(model_drafter, "WINDOW_PER_NEW_TOKEN", 1)
    monkeypatch.setattr(model_drafter, "DRAFT_WINDOW_MIN", 4)
    monkeypatch.setattr(model_drafter, "DRAFT_SINK", 2)
    model = specc.load(bundles["self"])
    first = {}
    catch_up = model_drafter.ModelDrafter.catch_up

    def watched(self, batch, warm=True):
        cold = [b for b, n in enumerate(batch.draft_state.lengths.tolist()) if n == 0]
        out = catch_up(self, batch, warm)
        for b in cold:
            s = batch.seqs[b]
            first.setdefault(tuple(s.prompt), (len(s.tokens) - 1 - s.draft_memo.get(model_drafter.SKIPPED, 0),
                                               s.max_new_tokens - len(s.out), len(s.tokens) - 1))
        return out

    monkeypatch.setattr(model_drafter.ModelDrafter, "catch_up", watched)
    long_prompts = [p * 2 for p in prompts[:6]]
    bad, _ = _mismatches(model, long_prompts, 3, k=3)
    assert bad == [] and first
    assert all(entered == min(context, 2 + max(4, left)) for entered, left, context in first.values())
    assert any(entered < context for entered, _, context in first.values())


def test_a_cold_row_takes_in_the_prompts_head_and_its_window(monkeypatch):
    """A long prompt enters the draft cache as its first DRAFT_SINK tokens and the window before the pending token,
    and SKIPPED maps the slots after the sink back to their tokens; a short one enters whole."""
    from types import SimpleNamespace

    from specc.runtime.drafters import model as model_drafter

    monkeypatch.setattr(model_drafter, "DRAFT_SINK", 3)
    monkeypatch.setattr(model_drafter, "DRAFT_WINDOW_MIN", 4)
    monkeypatch.setattr(model_drafter, "WINDOW_PER_NEW_TOKEN", 1)
    seq = SimpleNamespace(tokens=list(range(100, 120)), out=[], max_new_tokens=5, draft_memo={})
    entered = model_drafter._cold_tokens(seq)
    assert entered == [100, 101, 102, 114, 115, 116, 117, 118]
    skipped = seq.draft_memo[model_drafter.SKIPPED]
    assert all(seq.tokens[i + skipped] == t for i, t in enumerate(entered) if i >= 3)
    short = SimpleNamespace(tokens=list(range(8)), out=[], max_new_tokens=5, draft_memo={})
    assert model_drafter._cold_tokens(short) == list(range(7)) and short.draft_memo[model_drafter.SKIPPED] == 0


def test_float32_target_gives_a_token_the_same_bits_in_any_pass(bundles):
    """The float32 ONNX Runtime target attends with each key at its token's position: a token's logits and KV are
    the same bits inside a 4-token verify pass as in the 1-token passes that follow the cache; a tree graph (siblings
    side by side) keeps ONNX Runtime's attention."""
    import torch

    from specc.cli.format import format_manifest
    from specc.runtime.kv_cache import KVCache

    model = specc.load(bundles["draft"])
    assert model.bundle.graph("target").facts["attention_at_positions"] == 3
    assert "attention keys at their positions" in format_manifest(model.bundle.manifest, model.bundle.path, True)
    assert specc.load(bundles["tree_dynamic"]).bundle.graph("target").facts["attention_at_positions"] == 0
    step = model.target.step
    ids = torch.tensor([model.tokenizer.encode("def add(a, b):\n    return a + b\n" * 2)], dtype=torch.long)[:, :12]
    cache = KVCache(step.dims, 1, 64)
    out = dict(zip(step.output_names, step(ids[:, :8], cache, logit_index=torch.arange(8)[None])))
    cache.commit(out["new_k"], out["new_v"], torch.tensor([8]))
    four = dict(zip(step.output_names, step(ids[:, 8:12], cache, logit_index=torch.arange(4)[None])))
    for j in range(4):
        one = dict(zip(step.output_names, step(ids[:, 8 + j:9 + j], cache, logit_index=torch.tensor([[0]]))))
        assert torch.equal(one["logits"][:, 0], four["logits"][:, j])
        assert torch.equal(one["new_k"][..., 0, :], four["new_k"][..., j, :])
        cache.commit(one["new_k"], one["new_v"], torch.tensor([1]))
