"""Long prompts: chunked prefill, prefill interleaved with decoding rows, and the prefix cache.

Each must leave outputs as they were: greedy token for token, sampled with the same seed."""
from __future__ import annotations

import pytest
import torch

import specc
from specc.runtime.prefix_cache import BLOCK, PrefixCache
from specc.runtime.scheduler import Scheduler

LONG = ("def f(x):\n    return x * 2 + 1\n" * 7)[:190]  # byte tokenizer: 190 tokens, several chunks and blocks
PROMPTS = [LONG, "hello world", LONG[:77] + " and more", "x = f(y) + g(z)\n" * 5]


def _tokens(model, prompts=PROMPTS, **kw):
    return [c.token_ids for c in model.generate(prompts, max_new_tokens=16, **kw)]


@pytest.mark.parametrize("name", ["draft", "tree_dynamic", "verify_head"])
def test_chunked_prefill_changes_no_output(bundles, name):
    model = specc.load(bundles[name])
    model.set_prefix_cache_mb(0)
    model.prefill_chunk = 4096
    reference = _tokens(model, speculative=False)
    assert _tokens(model) == reference
    for chunk in (5, 64):
        model.prefill_chunk = chunk
        assert _tokens(model, speculative=False) == reference, chunk
        assert _tokens(model) == reference, chunk
    sampled = dict(temperature=0.8, seed=5)
    model.prefill_chunk = 4096
    whole = _tokens(model, **sampled)
    model.prefill_chunk = 7
    assert _tokens(model, **sampled) == whole


def test_chunked_prefill_gives_the_same_cache(bundles):
    model = specc.load(bundles["draft"])
    model.set_prefix_cache_mb(0)
    caches = []
    for chunk in (4096, 13):
        model.prefill_chunk = chunk
        scheduler = Scheduler(model, speculative=False)
        params = model.sampling_params()
        requests = [model.new_request(i, model.encode([p])[0], 4, params, 0) for i, p in enumerate(PROMPTS)]
        batch, first = scheduler.prefill(requests)
        caches.append((batch.cache, first))
    (a, first_a), (b, first_b) = caches
    assert first_a == first_b
    assert torch.equal(a.lengths, b.lengths)
    for row, n in enumerate(a.lengths.tolist()):
        torch.testing.assert_close(a.k[:, row, :, :n], b.k[:, row, :, :n], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(a.v[:, row, :, :n], b.v[:, row, :, :n], rtol=1e-4, atol=1e-5)


def test_long_prompt_prefills_beside_decoding_rows(bundles):
    """A prompt longer than a chunk is prefilled one chunk per step, and the running row gets a round
    after each chunk instead of waiting for the whole prompt."""
    model = specc.load(bundles["draft"])
    model.set_prefix_cache_mb(0)
    model.prefill_chunk, model.interleave_chunk = 64, 16
    reference = {i: t for i, t in enumerate(_tokens(model, ["short one", LONG], speculative=False))}
    scheduler = Scheduler(model, speculative=False)
    params = model.sampling_params()
    scheduler.submit(model.new_request(0, model.encode(["short one"])[0], 16, params, 0))
    out: dict[int, list[int]] = {0: scheduler.step()[0].token_ids, 1: []}  # the short prompt's first token
    scheduler.submit(model.new_request(1, model.encode([LONG])[0], 16, params, 1))
    decoded_while_prefilling = 0
    while scheduler.busy:
        events = scheduler.step()
        if scheduler.prefilling is not None:
            decoded_while_prefilling += sum(len(e.token_ids) for e in events if e.index == 0)
        for e in events:
            out[e.index] += e.token_ids
    assert decoded_while_prefilling >= 8  # beside a decoding row 190 tokens go in chunks of 16: 12 steps, a round each
    assert out == reference


def test_cancel_while_prefilling(bundles):
    model = specc.load(bundles["draft"])
    model.prefill_chunk = 16
    scheduler = Scheduler(model)
    scheduler.submit(model.new_request(0, model.encode([LONG])[0], 16, model.sampling_params(), 0))
    scheduler.step()
    assert scheduler.prefilling is not None
    scheduler.cancel(0)
    events = []
    while scheduler.busy:
        events += scheduler.step()
    assert events[-1].finish_reason == "cancelled" and events[-1].finished


@pytest.mark.parametrize("name", ["draft", "early_exit", "tree_dynamic"])
def test_prefix_cache_changes_no_output(bundles, name):
    model = specc.load(bundles[name])
    model.set_prefix_cache_mb(0)
    model.prefill_chunk = 32
    reference = _tokens(model)
    sampled = _tokens(model, temperature=0.8, seed=3)
    model.set_prefix_cache_mb(16)
    assert _tokens(model) == reference  # fills the cache
    assert _tokens(model) == reference  # reads it
    assert _tokens(model, temperature=0.8, seed=3) == sampled
    cache = model.prefix_cache
    assert cache.hits >= 2 * BLOCK and cache.queries > cache.hits and 0 < cache.bytes <= 16 << 20


def test_prefix_cache_reuses_a_previous_turn(bundles):
    """A second turn that starts with the first turn's prompt and answer reuses their whole blocks."""
    model = specc.load(bundles["draft"])
    model.set_prefix_cache_mb(16)
    prompt = model.encode([LONG[:120]])[0]
    first = model.generate([prompt], max_new_tokens=40)[0]
    turn = prompt + first.token_ids + model.encode([" next"])[0]
    before = model.prefix_cache.hits
    second = model.generate([turn], max_new_tokens=8)[0]
    committed = len(prompt) + len(first.token_ids) - 1  # the last generated token's KV was never computed
    assert committed // BLOCK > len(prompt) // BLOCK  # the answer completed a block of its own
    assert model.prefix_cache.hits - before == committed // BLOCK * BLOCK
    model.set_prefix_cache_mb(0)
    assert model.generate([turn], max_new_tokens=8)[0].token_ids == second.token_ids


def test_prefix_cache_stays_under_its_budget():
    dims = (2, 1, BLOCK, 4)  # [L, H, S, D] float32: 2 KiB per block's k or v
    block_bytes = 2 * torch.zeros(dims).nbytes
    cache = PrefixCache(5 * block_bytes)
    for i in range(40):
        tokens = [i] * (3 * BLOCK)
        k = torch.randn(2, 1, 3 * BLOCK, 4)
        cache.store(tokens, k, k.clone())
        assert cache.bytes <= cache.budget_bytes
    assert len(cache.blocks) == 5 and cache.bytes == 5 * block_bytes
    latest = [39] * (3 * BLOCK)
    assert len(cache.match(latest)) == 2  # the last block is left for the prefill to compute
    assert cache.match([0] * (3 * BLOCK)) == []  # evicted, least recently used first
    off = PrefixCache(0)
    off.store(latest, k, k)
    assert off.bytes == 0 and off.match(latest) == []


def test_max_context_model_is_the_targets_window(models_dir):
    from specc.compiler import model_window, resolve_context
    from specc.recipe import parse_recipe

    recipe = parse_recipe({"target": {"model": str(models_dir / "target")}, "draft": {"method": "prompt_lookup"}})
    assert recipe.limits.max_context == "model"
    window = model_window(str(models_dir / "target"))
    assert window and resolve_context(recipe).limits.max_context == min(window, 131072)
    fixed = parse_recipe({"target": {"model": str(models_dir / "target")}, "draft": {"method": "prompt_lookup"},
                          "limits": {"max_context": 96}})
    assert resolve_context(fixed) is fixed


def test_prompt_logprobs_read_chunk_by_chunk_equal_one_pass(bundles, monkeypatch):
    """Echo's prompt logprobs come chunk by chunk, no pass returning more than PROMPT_LOGITS logits, and
    equal those of one pass over the whole prompt (beside a row that asks for none)."""
    from specc.runtime import prefill

    model = specc.load(bundles["draft"])
    model.set_prefix_cache_mb(0)
    prompts = [LONG, "x = f(y) + g(z)\n" * 3, "hello world"]
    model.prefill_chunk = 4096
    whole = model.generate(prompts, max_new_tokens=4, logprobs=2, prompt_logprobs=True)
    vocab = model.target.dims.vocab_size
    monkeypatch.setattr(prefill, "PROMPT_LOGITS", 15 * vocab)  # 15 tokens per pass: 5 a row when 3 rows prefill together
    widest = []
    next_token = model.verifier.next_token

    def reading(cache, ids, rows, *args, prompt_at=None):
        widest.append(rows.numel() if prompt_at is not None else 0)
        return next_token(cache, ids, rows, *args, prompt_at=prompt_at)

    monkeypatch.setattr(model.verifier, "next_token", reading)
    for chunk in (64, 3):
        model.prefill_chunk = chunk
        widest.clear()
        parts = model.generate(prompts, max_new_tokens=4, logprobs=2, prompt_logprobs=True)
        assert 3 <= max(widest) <= 15  # logit rows of a pass
        for a, b, p in zip(parts, whole, model.encode(prompts)):
            assert a.token_ids == b.token_ids and len(a.prompt_logprobs) == len(p)
            assert [(t, alts and [i for i, _ in alts]) for t, _, alts in a.prompt_logprobs] == \
                   [(t, alts and [i for i, _ in alts]) for t, _, alts in b.prompt_logprobs]
            got = [x for _, x, _ in a.prompt_logprobs[1:]]
            assert got == pytest.approx([x for _, x, _ in b.prompt_logprobs[1:]], abs=1e-5)
    assert model.generate(["abc"], max_new_tokens=2)[0].prompt_logprobs is None
