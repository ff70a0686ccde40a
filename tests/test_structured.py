"""Penalties, logit_bias, logprobs and JSON-schema output (runtime/rules.py, runtime/grammar.py): exact under
speculation. Greedy speculation equals the transformed target-only output; logprobs equal an eager Hugging Face
reference; grammar-constrained output parses, validates and equals constrained target-only decoding."""
from __future__ import annotations

import json

import pytest
import torch

import specc

PENALTIES = {"presence_penalty": 1.5, "frequency_penalty": 0.7, "repetition_penalty": 1.3,
             "logit_bias": {"97": 4.0, "98": -100}}
SCHEMAS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["ok", "n"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3}},
     "required": ["color", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"inner": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9,
                                                                                      "maximum": 9},
                                                                                "y": {"type": "boolean"}},
                                                "required": ["x"], "additionalProperties": False},
                                      "name": {"type": "string", "maxLength": 4}},
     "required": ["inner", "name"], "additionalProperties": False},
]


def _parse(text: str):
    """JSON of a constrained output, parsed strictly: no raw control characters inside strings (RFC 8259)."""
    return json.loads(text)


@pytest.fixture(scope="module")
def prompts_few(prompts):
    return prompts[:4]


@pytest.mark.parametrize("name", ["draft", "prompt_lookup", "tree_dynamic"])
def test_penalties_greedy_speculation_equals_target_only(bundles, prompts_few, name):
    model = specc.load(bundles[name])
    fast = model.generate(prompts_few, max_new_tokens=20, **PENALTIES)
    slow = model.generate(prompts_few, max_new_tokens=20, speculative=False, **PENALTIES)
    plain = model.generate(prompts_few, max_new_tokens=20, speculative=False)
    assert [c.token_ids for c in fast] == [c.token_ids for c in slow]
    assert [c.token_ids for c in fast] != [c.token_ids for c in plain], "the penalties must change the output"
    assert all(98 not in c.token_ids for c in fast)  # bias -100


def test_logprobs_equal_eager_reference(bundles, models_dir, prompts_few):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(models_dir / "target").eval()
    model = specc.load(bundles["draft"])
    out = model.generate(prompts_few[:3], max_new_tokens=12, logprobs=3, prompt_logprobs=True)
    for p, c in zip(model.encode(prompts_few[:3]), out):
        ids = p + c.token_ids
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
        got = [lp for _, lp, _ in c.logprobs]
        want = ref[len(p) - 1:len(ids) - 1].gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(got), want, atol=1e-4)
        tops = [[a for a, _ in alts] for _, _, alts in c.logprobs]
        assert tops == ref[len(p) - 1:len(ids) - 1].topk(3, -1).indices.tolist()
        assert c.prompt_logprobs[0] == (p[0], None, [])
        prompt_lp = [lp for _, lp, _ in c.prompt_logprobs[1:]]
        want_p = ref[:len(p) - 1].gather(1, torch.tensor(p[1:])[:, None])[:, 0]
        assert torch.allclose(torch.tensor(prompt_lp), want_p, atol=1e-4)
        assert c.logprobs and all(t == tok for (t, _, _), tok in zip(c.logprobs, c.token_ids))


@pytest.mark.parametrize("name", ["draft", "prompt_lookup", "tree_dynamic"])
def test_json_schema_greedy_speculation_is_valid_and_exact(bundles, name):
    jsonschema = pytest.importorskip("jsonschema")
    model = specc.load(bundles[name])
    for schema in SCHEMAS:
        fast = model.generate(["a json:", "{{"], max_new_tokens=60, json_schema=schema)
        slow = model.generate(["a json:", "{{"], max_new_tokens=60, json_schema=schema, speculative=False)
        assert [c.token_ids for c in fast] == [c.token_ids for c in slow]
        for c in fast:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(_parse(c.text), schema)


# -- sampled: the distribution is the transformed target's -------------------------------------------------
from stats_helpers import FAIL_P, PASS_P, chi2_pvalue, total_variation  # noqa: E402

VOCAB, PROMPT, N = 24, [3, 1, 4, 1, 5], 3072
SAMPLED_PENALTIES = {"presence_penalty": 2.0, "frequency_penalty": 2.0, "repetition_penalty": 1.2,
                     "logit_bias": {"7": 2.0, "2": -100}}
DIGITS = {"type": "string", "pattern": "^[0-4][5-8][0-8]$"}  # the byte tokenizer's ids 15..23 are "0".."8"


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    from conftest import small_chain_bundle

    return small_chain_bundle(tmp_path_factory.mktemp("rules_small"), VOCAB)


def _reference_transform(logits, prompt, out, rules):
    """An independent eager statement of the documented order: repetition, presence/frequency, bias, then mask."""
    logits = logits.clone()
    r = rules.get("repetition_penalty", 1.0)
    for t in set(prompt) | set(out):
        logits[t] = logits[t] / r if logits[t] > 0 else logits[t] * r
    for t in set(out):
        logits[t] -= rules.get("frequency_penalty", 0.0) * out.count(t) + rules.get("presence_penalty", 0.0)
    for t, b in rules.get("logit_bias", {}).items():
        logits[int(t)] += b
    allowed = rules.get("allowed")
    if allowed is not None:
        mask = torch.full_like(logits, float("-inf"))
        mask[allowed[len(out)]] = 0
        logits = logits + mask
    return torch.softmax(logits, -1)


_MARGINALS: dict = {}


def _exact_marginals(target, rules):
    """P(t1), P(t2), P(t3) of the target under the rules, by enumerating every context of the first two tokens."""
    key = (str(target), json.dumps(rules, sort_keys=True))
    if key in _MARGINALS:
        return _MARGINALS[key]
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(target).eval()
    pairs = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))
    with torch.no_grad():
        l1 = hf(torch.tensor([PROMPT])).logits[0, -1].float()
        l2 = hf(torch.cat([torch.tensor(PROMPT).expand(VOCAB, -1), torch.arange(VOCAB)[:, None]], 1)).logits[:, -1].float()
        l3 = hf(torch.cat([torch.tensor(PROMPT).expand(len(pairs), -1), pairs], 1)).logits[:, -1].float()
    p1 = _reference_transform(l1, PROMPT, [], rules)
    m2, m3 = torch.zeros(VOCAB), torch.zeros(VOCAB)
    for a in range(VOCAB):
        if p1[a] < 1e-9:
            continue
        p2 = _reference_transform(l2[a], PROMPT, [a], rules)
        m2 += p1[a] * p2
        for b in range(VOCAB):
            if p1[a] * p2[b] > 1e-9:
                m3 += p1[a] * p2[b] * _reference_transform(l3[a * VOCAB + b], PROMPT, [a, b], rules)
    _MARGINALS[key] = p1.numpy(), m2.numpy(), m3.numpy()
    return _MARGINALS[key]


def _draw(bundle, **kwargs):
    import numpy as np

    model = specc.load(bundle)
    out = []
    for lo in range(0, N, 512):
        done = model.generate([PROMPT] * 512, max_new_tokens=3, seed=list(range(lo, lo + 512)), temperature=1.0, **kwargs)
        out += [c.token_ids for c in done]
    assert model.last_stats.to_dict()["acceptance_rate"] > 0.05
    return np.array(out)


def _untransformed_target(self, logits, drafts=None, start=0):
    """The broken twin of BatchRules.apply: the drafter draws from the penalised distribution and reports it
    as q, but the target's verify pass (several positions) is left as the model gives it."""
    if logits.dim() == 3 and logits.shape[1] > 1:
        return logits
    return _apply(self, logits, drafts, start)


from specc.runtime.rules import BatchRules  # noqa: E402

_apply = BatchRules.apply


@pytest.mark.parametrize("broken", [False, True], ids=["exact", "broken-twin"])
def test_sampled_penalties_follow_the_penalised_target(small, monkeypatch, broken):
    """Each verified position is penalised for the output and the drafts before it (the exact marginals of the
    third token depend on that); a twin whose target pass is not penalised is caught."""
    target, bundle = small
    exact = _exact_marginals(target, SAMPLED_PENALTIES)
    if broken:
        monkeypatch.setattr(BatchRules, "apply", _untransformed_target)
    samples = _draw(bundle, **SAMPLED_PENALTIES)
    assert chi2_pvalue(samples[:, 0], exact[0]) > PASS_P  # the first token comes from the prefill, untouched
    p = [chi2_pvalue(samples[:, i], exact[i]) for i in (1, 2)]
    tv = [round(total_variation(samples[:, i], exact[i]), 3) for i in (1, 2)]
    assert (min(p) < FAIL_P) if broken else (min(p) > PASS_P), f"p {p}, TV {tv}"


@pytest.mark.parametrize("broken", [False, True], ids=["exact", "broken-twin"])
def test_sampled_grammar_follows_the_constrained_target(small, monkeypatch, broken):
    """Sampled output under a pattern grammar has the masked target's distribution; a drafter that draws
    from the masked distribution but reports the unmasked one as its q is caught."""
    from specc.runtime.drafters import loops

    target, bundle = small
    allowed = [[1], list(range(15, 20)), list(range(20, 24))]  # '"', then [0-4], then [5-8]
    exact = _exact_marginals(target, {"allowed": allowed})
    if broken:
        seen = {}

        def apply(self, logits, drafts=None, start=0):
            seen["raw"] = logits
            return _apply(self, logits, drafts, start)

        def choose(logits, params, u):
            tok, _ = _choose(logits, params, u)
            return tok, _choose(seen["raw"], params, u)[1]  # q of the unmasked logits

        _choose = loops.choose
        monkeypatch.setattr(BatchRules, "apply", apply)
        monkeypatch.setattr(loops, "choose", choose)
    samples = _draw(bundle, json_schema=DIGITS)
    assert set(samples[:, 0]) == {1}
    p = [chi2_pvalue(samples[:, i], exact[i]) for i in (1, 2)]
    tv = [round(total_variation(samples[:, i], exact[i]), 3) for i in (1, 2)]
    assert (min(p) < FAIL_P) if broken else (min(p) > PASS_P), f"p {p}, TV {tv}"


# -- through specc serve and the openai client -------------------------------------------------------------
@pytest.fixture(scope="module")
def served(bundles):
    pytest.importorskip("fastapi")
    from test_serving import Server
    from specc.serving.app import create_app

    model = specc.load(bundles["draft"])
    s = Server(create_app(model, name="tiny", k=3))
    yield s, model
    s.stop()


def _ask(client, schema, prompt, chat, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}
    kw = dict(model="tiny", max_tokens=60, temperature=0, response_format=fmt, stream=stream)
    if chat:
        r = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kw)
        return "".join(c.choices[0].delta.content or "" for c in r if c.choices) if stream else r.choices[0].message.content
    r = client.completions.create(prompt=prompt, extra_body={"response_format": fmt},
                                  **{k: v for k, v in kw.items() if k != "response_format"})
    return "".join(c.choices[0].text for c in r if c.choices) if stream else r.choices[0].text


def test_json_schemas_through_the_openai_client_at_concurrency_4(served):
    """Every schema, chat and completions, streamed and not, four requests at a time with speculation on:
    the output parses, validates and equals the constrained target-only output."""
    from concurrent.futures import ThreadPoolExecutor

    jsonschema = pytest.importorskip("jsonschema")
    s, model = served
    client = s.client()
    jobs = [(i, prompt, chat, stream) for i in range(len(SCHEMAS)) for prompt in ("a json:", "{{")
            for chat in (False, True) for stream in (False, True)]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda j: _ask(client, SCHEMAS[j[0]], j[1], j[2], j[3]), jobs))
    want = {}
    for (i, prompt, chat, _), text in zip(jobs, got):
        jsonschema.validate(_parse(text), SCHEMAS[i])
        if (i, prompt, chat) not in want:
            want[i, prompt, chat] = model.generate([prompt], max_new_tokens=60, json_schema=SCHEMAS[i], chat=chat,
                                                   speculative=False)[0].text
        assert text == want[i, prompt, chat]


def test_json_object_mode(served):
    s, _ = served
    r = s.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=80,
                                           temperature=0, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # a random model may write a long object; what it wrote is still a JSON object's beginning
        assert r.choices[0].message.content.startswith("{")


def test_logprobs_through_the_api_equal_generate(served):
    s, model = served
    client = s.client()
    want = model.generate(["abc"], max_new_tokens=8, logprobs=2, prompt_logprobs=True)[0]
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "abc"}], max_tokens=8,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    c = client.completions.create(model="tiny", prompt="abc", max_tokens=8, temperature=0, logprobs=2, echo=True)
    lp = c.choices[0].logprobs
    n_prompt = len(model.encode(["abc"])[0])
    assert c.choices[0].text.startswith("abc") and lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:n_prompt] == pytest.approx([x for _, x, _ in want.prompt_logprobs[1:]], abs=1e-5)
    assert lp.token_logprobs[n_prompt:] == pytest.approx([x for _, x, _ in want.logprobs], abs=1e-5)
    streamed = client.completions.create(model="tiny", prompt="abc", max_tokens=8, temperature=0, logprobs=2, stream=True)
    values = [v for ch in streamed if ch.choices and ch.choices[0].logprobs for v in ch.choices[0].logprobs.token_logprobs]
    assert values == pytest.approx([x for _, x, _ in want.logprobs], abs=1e-5)


def test_penalties_through_the_api_equal_generate(served):
    s, model = served
    want = model.generate(["abc"], max_new_tokens=16, **PENALTIES)[0].text
    r = s.client().completions.create(model="tiny", prompt="abc", max_tokens=16, temperature=0,
                                      presence_penalty=1.5, frequency_penalty=0.7, logit_bias={"97": 4.0, "98": -100},
                                      extra_body={"repetition_penalty": 1.3})
    assert r.choices[0].text == want


@pytest.mark.parametrize("chat, change, param", [
    (False, {"presence_penalty": 3}, "presence_penalty"),
    (False, {"frequency_penalty": -2.5}, "frequency_penalty"),
    (False, {"frequency_penalty": "1"}, "frequency_penalty"),
    (False, {"repetition_penalty": 0}, "repetition_penalty"),
    (False, {"logit_bias": {"x": 1}}, "logit_bias"),
    (False, {"logit_bias": {"5": 101}}, "logit_bias"),
    (False, {"logit_bias": {"99999": 1}}, "logit_bias"),
    (False, {"logit_bias": [1, 2]}, "logit_bias"),
    (False, {"logprobs": 6}, "logprobs"),
    (False, {"logprobs": -1}, "logprobs"),
    (False, {"logprobs": True}, "logprobs"),
    (False, {"echo": "yes"}, "echo"),
    (True, {"logprobs": 1}, "logprobs"),
    (True, {"top_logprobs": 2}, "top_logprobs"),
    (True, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (True, {"response_format": {"type": "xml"}}, "response_format.type"),
    (True, {"response_format": {"type": "json_schema"}}, "response_format"),
    (True, {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    (True, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
     "response_format"),
    (True, {"response_format": "json"}, "response_format"),
    (False, {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "integer", "minimum": "a"}}}},
     "response_format"),
])
def test_bad_values_of_the_new_fields_are_400s_naming_them(served, chat, change, param):
    s, _ = served
    body = {"model": "tiny", "max_tokens": 3, **({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})}
    r = s.post("/v1/chat/completions" if chat else "/v1/completions", {**body, **change})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"], err


def test_a_verify_head_bundle_refuses_host_rules_clearly(bundles):
    model = specc.load(bundles["verify_head"])
    from specc.errors import RequestError

    for kw in ({"logprobs": 1}, {"presence_penalty": 1.0}, {"json_schema": SCHEMAS[0]}):
        with pytest.raises(RequestError, match="verification head"):
            model.generate(["ab"], max_new_tokens=4, **kw)


def test_generate_cli_takes_a_json_schema_file(bundles, tmp_path, capsys):
    from specc.cli import main

    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMAS[0]))
    assert main(["generate", str(bundles["draft"]), "--prompt", "hi", "--json-schema", str(schema),
                 "--max-new-tokens", "40", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(_parse(out["completions"][0])) == {"ok", "n"}
    schema.write_text("[1, 2]")
    assert main(["generate", str(bundles["draft"]), "--prompt", "hi", "--json-schema", str(schema)]) == 2


def test_tokens_with_control_characters_are_masked_in_json():
    """The grammar's masks also forbid tokens holding a raw control character (JSON strings may not
    contain one unescaped); a stop token stays allowed whatever its bytes."""
    from specc.runtime.grammar import printable_mask

    vocab = [b"a", b"\x01", b"b\nc", b"\t", b"{", b"\x00", b"ok"] + [b"x"] * 30
    mask = printable_mask(vocab, len(vocab), eos_ids=[5])
    bits = [bool((int(mask[i // 32]) >> (i % 32)) & 1) for i in range(len(vocab))]
    assert bits[:7] == [True, False, False, False, True, True, True] and all(bits[7:])
