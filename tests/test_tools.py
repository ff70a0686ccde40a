"""OpenAI tool calling (serving/tools.py, tool_formats.py): calls read back whole and streamed alike, every call
of `required` and a named tool parses and validates, bad tools are 400s naming the field, and the grammar
keeps speculation exact: greedy equals constrained target-only, sampled follows the constrained target."""
from __future__ import annotations

import json
import random

import pytest
import torch

import specc
from specc.serving.tool_formats import FORMATS, CallParser, CallStart, Arguments, Content, ToolFormat, structural_tag
from specc.serving.tools import ChoiceCalls

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

# templates for the byte-level test tokenizer: tool names only (short prompts), calls as each family writes them
HERMES = ("{% if tools %}<tools>{% for t in tools %}{{ t.function.name }} {% endfor %}</tools>\n{% endif %}"
          "{% for m in messages %}<{{ m.role }}>{% if m.content %}{{ m.content }}{% endif %}"
          "{% for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
          "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}\n{% endfor %}<assistant>")
PLAIN = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
UNKNOWN_FORMAT = "{% if tools %}{% for t in tools %}{{ t.function.name }} {% endfor %}{% endif %}" + PLAIN

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": -9, "maximum": 9}}, "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather in a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
# a fuzz corpus of argument schemas: nested objects, enums, arrays, optional fields, formats, no parameters at all
FUZZ = [
    {"type": "object", "properties": {"inner": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -5, "maximum": 5}, "ok": {"type": "boolean"}}, "required": ["x"]}},
     "required": ["inner"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1,
                                               "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"mode": {"enum": ["fast", "slow", 3, None]},
                                      "note": {"type": "string", "maxLength": 4}}, "required": ["mode"]},
    {"type": "object", "properties": {"when": {"type": "string", "format": "date"},
                                      "n": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["when", "n"]},
    {"type": "object", "properties": {"pairs": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"k": {"type": "string", "maxLength": 3}, "v": {"type": "integer", "minimum": 0,
                                                                                       "maximum": 9}},
        "required": ["k", "v"]}}}, "required": ["pairs"]},
    {"type": "object", "properties": {"flag": {"type": "boolean"}, "opt": {"type": "string", "maxLength": 2}}},
    {"type": "object", "properties": {}},
]


def _tool(name: str, schema: dict | None) -> dict:
    function = {"name": name} if schema is None else {"name": name, "parameters": schema}
    return {"type": "function", "function": function}


# -- reading calls back ------------------------------------------------------------------------------------
def _read(fmt: ToolFormat, text: str, cuts: list[int]):
    parser, events = CallParser(fmt), []
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    for i, piece in enumerate(pieces):
        events += parser.feed(piece, i == len(pieces) - 1)
    content = "".join(e.text for e in events if isinstance(e, Content))
    calls: dict = {}
    for e in events:
        if isinstance(e, CallStart):
            calls[e.index] = [e.name, ""]
        elif isinstance(e, Arguments):
            calls[e.index][1] += e.text
    return content, list(calls.values())


WRITTEN = {  # a reply with text and two calls as each family writes it; arguments with braces and quotes in strings
    "hermes": 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "P}a\\"r", "x": [1, {"y": 2}]}}'
              '\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>',
    "mistral": 'Let me check.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "P}a\\"r", "x": [1, {"y": 2}]}}, '
               '{"name": "add", "arguments": {}}]',
    "llama3_json": 'Let me check.{"name": "get_weather", "parameters": {"city": "P}a\\"r", "x": [1, {"y": 2}]}}'
                   '{"name": "add", "parameters": {}}',
}


@pytest.mark.parametrize("fmt", FORMATS, ids=[f.name for f in FORMATS])
def test_calls_read_the_same_whole_and_in_any_pieces(fmt):
    text = WRITTEN[fmt.name]
    whole = _read(fmt, text, [])
    calls = [["get_weather", '{"city": "P}a\\"r", "x": [1, {"y": 2}]}'], ["add", "{}"]]
    assert (whole[0].rstrip(), whole[1]) == ("Let me check.", calls)
    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted({rng.randrange(1, len(text)) for _ in range(rng.randint(1, 40))})
        assert _read(fmt, text, cuts) == whole, cuts


def test_cut_short_text_stays_text_and_a_cut_call_keeps_what_it_had():
    hermes = FORMATS[0]
    assert _read(hermes, "a < b <tool", [3]) == ("a < b <tool", [])
    assert _read(hermes, 'hi <tool_call>\n{"na', []) == ('hi <tool_call>\n{"na', [])
    assert _read(hermes, 'hi <tool_call>\n{"name": "f", "arguments": {"a": 1', []) == ("hi ", [["f", '{"a": 1']])


def test_streamed_content_and_calls_join_to_the_whole_message():
    text = "\n\nI'll add.\n " + WRITTEN["hermes"].split("Let me check.", 1)[1] + "\n"
    whole = ChoiceCalls(FORMATS[0]).message(text)
    streamed, calls = ChoiceCalls(FORMATS[0]), {}
    content = ""
    for i in range(0, len(text), 3):
        for d in streamed.deltas(text[i:i + 3], i + 3 >= len(text)):
            content += d.get("content", "")
            for c in d.get("tool_calls", []):
                entry = calls.setdefault(c["index"], {"name": "", "arguments": ""})
                entry["name"] += c.get("function", {}).get("name", "")
                entry["arguments"] += c["function"]["arguments"]
    assert whole["content"] == content == "\n\nI'll add."
    assert [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in whole["tool_calls"]] == \
        [calls[0], calls[1]]


def test_docs_list_every_format():
    from pathlib import Path

    doc = (Path(__file__).parent.parent / "docs" / "serving.md").read_text()
    assert all(f"| `{f.name}` |" in doc for f in FORMATS)


# -- the grammar -------------------------------------------------------------------------------------------
def _accepts(tag: str, text: str) -> bool:
    import xgrammar as xgr

    return xgr.testing._is_grammar_accept_string(xgr.Grammar.from_structural_tag(tag), text)


@pytest.mark.parametrize("fmt", FORMATS, ids=[f.name for f in FORMATS])
def test_the_grammar_takes_each_family_s_calls_and_nothing_else(fmt):
    from specc.runtime.grammar import schema_ebnf

    tools = [("get_weather", schema_ebnf(json.dumps(WEATHER))), ("add", schema_ebnf(json.dumps(ADD)))]
    call = fmt.call_begin("add") + '{"a": 1, "b": -2}' + fmt.call_close + fmt.block_close
    bad = fmt.call_begin("add") + '{"a": 100, "b": -2}' + fmt.call_close + fmt.block_close  # a out of range
    assert _accepts(structural_tag(fmt, tools, "required", True), call)
    assert not _accepts(structural_tag(fmt, tools, "required", True), "Sure. " + call)
    assert not _accepts(structural_tag(fmt, tools, "required", True), bad)
    assert _accepts(structural_tag(fmt, tools, "auto", True), "Sure. " + call)
    assert _accepts(structural_tag(fmt, tools, "auto", True), "No call needed.")
    assert not _accepts(structural_tag(fmt, tools, "auto", True), "Sure. " + bad)
    assert _accepts(structural_tag(fmt, tools, "add", True), call)
    assert not _accepts(structural_tag(fmt, tools, "get_weather", True), call)
    assert not _accepts(structural_tag(fmt, tools, "none", True), "Sure. " + call)


# -- greedy speculation under the tool grammar equals constrained target-only ------------------------------
TILDE = ToolFormat("tilde", "tests", "~", "~", "~", '{"name": "', '", "arguments": ', "}", "", block_sep=" ")


def _tags() -> dict[str, str]:
    from specc.runtime.grammar import schema_ebnf

    tools = [("get_weather", schema_ebnf(json.dumps(WEATHER))), ("add", schema_ebnf(json.dumps(ADD)))]
    return {"required": structural_tag(FORMATS[0], tools, "required", True),
            "named": structural_tag(FORMATS[0], tools, "add", False),
            # the random model writes "~" often: free text, then calls opened by the trigger
            "auto": structural_tag(TILDE, tools, "auto", True)}


@pytest.mark.parametrize("name", ["draft", "self", "wrong", "prompt_lookup", "tree_dynamic"])
def test_greedy_tool_calls_equal_constrained_target_only(bundles, prompts, name):
    """Always-right (self), always-wrong (wrong), partly right drafts, lookup and trees: token for token."""
    model = specc.load(bundles[name])
    calls = 0
    for choice, tag in _tags().items():
        fast = model.generate(prompts[:4], max_new_tokens=60, structural_tag=tag)
        slow = model.generate(prompts[:4], max_new_tokens=60, structural_tag=tag, speculative=False)
        assert [c.token_ids for c in fast] == [c.token_ids for c in slow], choice
        fmt = TILDE if choice == "auto" else FORMATS[0]
        for c in fast:
            message = ChoiceCalls(fmt).message(c.text)
            calls += len(message.get("tool_calls", []))
            if choice != "auto" and c.finish_reason == "stop":
                for call in message["tool_calls"]:
                    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    assert calls >= 8


# -- sampled: the distribution is the constrained target's -------------------------------------------------
from stats_helpers import FAIL_P, PASS_P, chi2_pvalue, total_variation  # noqa: E402

VOCAB, PROMPT, N = 66, [3, 1, 4, 1, 5], 3072
LT, A, B, EQ = 27, 64, 65, 28  # "<", "a", "b", "=" in the byte tokenizer
SHORT = ToolFormat("short", "tests", "<", "<", "<", "", "=", "", "")


def _allowed(prefix: list[int]) -> list[int]:
    """What the auto grammar of tools "a" and "ab" (format "<NAME=ARGS") allows next, stated by hand: free text
    until "<", then a tool's name, then "="."""
    if prefix and prefix[-1] == LT:
        return [A]
    if len(prefix) >= 2 and prefix[-2] == LT and prefix[-1] == A:
        return [B, EQ]
    return list(range(VOCAB))


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    from conftest import small_chain_bundle

    return small_chain_bundle(tmp_path_factory.mktemp("tools_small"), VOCAB)


def _marginals(target, bias: float) -> tuple:
    """P(t1), P(t2), P(t3) of the target with "<" biased and the grammar's masks, over every context."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(target).eval()
    pairs = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))
    with torch.no_grad():
        l1 = hf(torch.tensor([PROMPT])).logits[0, -1].float()
        l2 = hf(torch.cat([torch.tensor(PROMPT).expand(VOCAB, -1), torch.arange(VOCAB)[:, None]], 1)).logits[:, -1].float()
        l3 = hf(torch.cat([torch.tensor(PROMPT).expand(len(pairs), -1), pairs], 1)).logits[:, -1].float()

    def dist(logits, prefix):
        logits = logits.clone()
        logits[LT] += bias
        mask = torch.full_like(logits, float("-inf"))
        mask[_allowed(prefix)] = 0
        return torch.softmax(logits + mask, -1)

    p1 = dist(l1, [])
    m2, m3 = torch.zeros(VOCAB), torch.zeros(VOCAB)
    for a in range(VOCAB):
        p2 = dist(l2[a], [a])
        m2 += p1[a] * p2
        for b in range(VOCAB):
            m3 += p1[a] * p2[b] * dist(l3[a * VOCAB + b], [a, b])
    return p1.numpy(), m2.numpy(), m3.numpy()


@pytest.mark.parametrize("broken", [False, True], ids=["exact", "broken-twin"])
def test_sampled_tool_calls_follow_the_constrained_target(small, monkeypatch, broken):
    """Sampled output under an auto tool grammar (free text, then a call opened by "<") has the masked target's
    distribution; a drafter that draws from the masked distribution but reports the unmasked q is caught."""
    import numpy as np

    from specc.runtime.drafters import loops
    from specc.runtime.grammar import schema_ebnf
    from specc.runtime.rules import BatchRules

    target, bundle = small
    exact = _marginals(target, 3.0)
    if broken:
        seen, apply, choose = {}, BatchRules.apply, loops.choose

        def raw_apply(self, logits, drafts=None, start=0):
            seen["raw"] = logits
            return apply(self, logits, drafts, start)

        monkeypatch.setattr(BatchRules, "apply", raw_apply)
        monkeypatch.setattr(loops, "choose", lambda logits, params, u: (choose(logits, params, u)[0],
                                                                        choose(seen["raw"], params, u)[1]))
    ebnf = schema_ebnf(json.dumps({"type": "object"}))
    tag = structural_tag(SHORT, [("a", ebnf), ("ab", ebnf)], "auto", True)
    model = specc.load(bundle)
    samples = []
    for lo in range(0, N, 512):
        done = model.generate([PROMPT] * 512, max_new_tokens=3, seed=list(range(lo, lo + 512)), temperature=1.0,
                              structural_tag=tag, logit_bias={str(LT): 3.0})
        samples += [c.token_ids for c in done]
    assert model.last_stats.to_dict()["acceptance_rate"] > 0.05
    samples = np.array(samples)
    assert (samples[:, 1][samples[:, 0] == LT] == A).all()  # the grammar holds after the trigger
    p = [chi2_pvalue(samples[:, i], exact[i]) for i in (0, 1, 2)]
    tv = [round(total_variation(samples[:, i], exact[i]), 3) for i in (0, 1, 2)]
    assert p[0] > PASS_P, (p, tv)  # the first token comes from the prefill
    assert (min(p[1:]) < FAIL_P) if broken else (min(p[1:]) > PASS_P), f"p {p}, TV {tv}"
