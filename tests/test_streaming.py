"""Streaming, stop strings, EOS and per-request seeds through the runtime API."""
from __future__ import annotations

import pytest

import specc
from specc.errors import RequestError
from specc.runtime.text import TextStream
from specc.testing import byte_tokenizer


def test_text_stream_holds_back_possible_stop_prefix():
    tok = byte_tokenizer()
    ids = tok("hello STOP world")["input_ids"]
    stream = TextStream(tok, ("STOP",))
    released = ""
    for n in range(1, len(ids) + 1):
        delta, hit = stream.update(ids[:n], final=False)
        released += delta
        assert "S" not in released or hit
        if hit:
            break
    assert released == "hello " and hit


def test_text_stream_holds_partial_utf8():
    tok = byte_tokenizer()
    ids = tok("é!")["input_ids"]  # é is two bytes: two tokens
    stream = TextStream(tok)
    assert stream.update(ids[:1], final=False)[0] == ""
    assert stream.update(ids[:2], final=False)[0] == "é"
    assert stream.update(ids, final=True)[0] == "!"


def test_stream_events_concatenate_to_generate(bundles):
    model = specc.load(bundles["draft"])
    prompts = ["abc", "hello there", "x"]
    full = model.generate(prompts, max_new_tokens=15, k=3)
    texts, tokens, finished = {}, {}, set()
    for ev in model.stream(prompts, max_new_tokens=15, k=3):
        assert ev.index not in finished
        texts[ev.index] = texts.get(ev.index, "") + ev.text
        tokens[ev.index] = tokens.get(ev.index, []) + ev.token_ids
        if ev.finished:
            finished.add(ev.index)
    assert finished == {0, 1, 2}
    for c in full:
        assert texts[c.index] == c.text and tokens[c.index] == c.token_ids


def test_stop_string_cuts_text(bundles):
    model = specc.load(bundles["draft"])
    free = model.generate(["abc"], max_new_tokens=30)[0]
    stop = free.text[5:7]
    assert stop, "needs generated text"
    cut = model.generate(["abc"], max_new_tokens=30, stop=[stop])[0]
    assert cut.finish_reason == "stop" and cut.text == free.text[: free.text.index(stop)]


def test_max_new_tokens_and_finish_reason(bundles):
    model = specc.load(bundles["draft"])
    for n in (1, 2, 7):
        c = model.generate(["abc"], max_new_tokens=n, k=4)[0]
        assert len(c.token_ids) == n and c.finish_reason == "length"


def test_eos_stops_a_row(bundles):
    """Force EOS by declaring the first generated token an end token: output is empty, reason stop."""
    model = specc.load(bundles["draft"])
    first = model.generate(["abc"], max_new_tokens=1)[0].token_ids[0]
    model.eos_ids = {first}
    c = model.generate(["abc"], max_new_tokens=10)[0]
    assert c.token_ids == [] and c.finish_reason == "stop"


def test_seeds_make_sampling_reproducible_per_row(bundles):
    model = specc.load(bundles["draft"])
    a = model.generate(["abc", "abc"], max_new_tokens=12, temperature=1.0, seed=[7, 8])
    b = model.generate(["zzz", "abc"], max_new_tokens=12, temperature=1.0, seed=[1, 8])
    c = model.generate(["abc"], max_new_tokens=12, temperature=1.0, seed=[7])
    assert a[1].token_ids == b[1].token_ids  # same prompt and seed, other batch companions
    assert a[0].token_ids == c[0].token_ids
    assert a[0].token_ids != a[1].token_ids


def test_more_prompts_than_max_batch(bundles):
    model = specc.load(bundles["draft"])
    prompts = [f"p{i}" for i in range(9)]  # max_batch is 4
    outs = model.generate(prompts, max_new_tokens=5)
    assert [c.index for c in outs] == list(range(9))
    assert all(len(c.token_ids) == 5 if c.finish_reason == "length" else c.finish_reason == "stop" for c in outs)


@pytest.mark.parametrize("kwargs, message", [
    ({"prompts": []}, "non-empty list"),
    ({"prompts": "abc"}, None),
    ({"prompts": [[1, 2, 99999]]}, "outside the vocabulary"),
    ({"prompts": [3.5]}, "must be a non-empty string or list of token ids"),
    ({"prompts": ["a"], "seed": [1, 2]}, "one int per prompt"),
    ({"prompts": ["a"], "stop": "x"}, "list of non-empty strings"),
    ({"prompts": ["a"], "k": 40}, "k must be an integer in"),
])
def test_bad_requests(bundles, kwargs, message):
    model = specc.load(bundles["draft"])
    if message is None:  # a bare string is one prompt, not a list of characters
        assert len(model.generate(kwargs["prompts"], max_new_tokens=2)) == 1
        return
    with pytest.raises(RequestError, match=message):
        (model.generate(**kwargs, max_new_tokens=2) if "prompts" not in kwargs
         else model.generate(kwargs.pop("prompts"), max_new_tokens=2, **kwargs))


def test_requests_join_a_running_batch(bundles, prompts):
    """Continuous batching: rows admitted between rounds get the same output as alone."""
    from specc.runtime.scheduler import Scheduler

    model = specc.load(bundles["draft"])
    greedy, sampled = model.sampling_params(0.0), model.sampling_params(1.0, 20, 0.9)
    requests = [(prompts[i], greedy if i % 2 else sampled, 40 + i) for i in range(6)]
    sched = Scheduler(model, k=3)
    outs: dict[int, list[int]] = {}
    submitted = 0
    while submitted < len(requests) or sched.busy:
        if submitted < len(requests):  # a new request arrives every step
            text, params, seed = requests[submitted]
            sched.submit(model.new_request(submitted, model.encode([text])[0], 12, params, seed, k=3))
            submitted += 1
        for ev in sched.step():
            outs[ev.index] = outs.get(ev.index, []) + ev.token_ids
        assert sched.batch is None or len(sched.batch.seqs) <= model.max_batch
    for i, (text, params, seed) in enumerate(requests):
        alone = model.generate([text], max_new_tokens=12, k=3, seed=seed, temperature=params.temperature,
                               top_k=params.top_k, top_p=params.top_p)[0]
        assert outs[i] == alone.token_ids, i
