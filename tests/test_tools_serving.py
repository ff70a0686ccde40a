"""Tool calling through a live `specc serve` with real clients: the openai SDK (tools, streaming, n: 2) and the
OpenAI Agents SDK driving a multi-step loop; a fuzz corpus of tool schemas under tool_choice required; bad tools
as 400s naming the field. The heavy test runs the agent loop on a catalog model (Qwen2.5-Coder-0.5B)."""
from __future__ import annotations

import json
import threading
from typing import Literal

import pytest

import specc
from specc.serving.tools import ChoiceCalls, plan as plan_tools
from test_tools import ADD, FUZZ, HERMES, PLAIN, SCHEMAS, TOOLS, UNKNOWN_FORMAT, _tool

pytest.importorskip("fastapi")
jsonschema = pytest.importorskip("jsonschema")
MESSAGES = [{"role": "user", "content": "add 2 and 3"}]


@pytest.fixture(scope="module")
def served(models_dir, tmp_path_factory):
    from conftest import build_bundle, built_once
    from test_serving import Server
    from specc.serving.app import create_app

    bundle = built_once(tmp_path_factory, "bundles/tools_draft", lambda out: build_bundle(
        out, models_dir / "target", {"method": "model", "model": str(models_dir / "draft")},
        limits={"max_batch": 4, "max_context": 1024}))
    model = specc.load(bundle)
    model.set_chat_template(HERMES)
    s = Server(create_app(model, name="tiny", k=3))
    yield s, model
    s.stop()


def _streamed(chunks) -> list[dict]:
    """The choices of a stream, assembled as a whole reply's messages are."""
    out: dict[int, dict] = {}
    for chunk in chunks:
        for ch in chunk.choices:
            entry = out.setdefault(ch.index, {"content": "", "calls": {}, "finish": None})
            entry["content"] += ch.delta.content or ""
            for c in ch.delta.tool_calls or []:
                call = entry["calls"].setdefault(c.index, {"id": c.id, "name": "", "arguments": ""})
                call["name"] += (c.function.name or "") if c.function else ""
                call["arguments"] += (c.function.arguments or "") if c.function else ""
            entry["finish"] = ch.finish_reason or entry["finish"]
    return [{"content": e["content"] or None, "finish": e["finish"],
             "calls": [(c["name"], c["arguments"]) for _, c in sorted(e["calls"].items())]} for _, e in sorted(out.items())]


def _whole(choices) -> list[dict]:
    return [{"content": c.message.content, "finish": c.finish_reason,
             "calls": [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]} for c in choices]


def _valid(calls, schemas) -> None:
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), schemas[name])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}], ids=["required", "named"])
def test_calls_parse_validate_stream_like_whole_and_equal_target_only(served, choice):
    s, model = served
    client = s.client()
    kw = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=120, temperature=0)
    whole = _whole(client.chat.completions.create(n=2, **kw).choices)
    streamed = _streamed(client.chat.completions.create(n=2, stream=True, **kw))
    assert whole == streamed
    assert whole[0] == whole[1]  # greedy: both samples alike
    assert whole[0]["finish"] == "tool_calls" and whole[0]["calls"]
    _valid(whole[0]["calls"], SCHEMAS)
    if isinstance(choice, dict):
        assert {name for name, _ in whole[0]["calls"]} == {"add"}
    # the constrained target alone writes the same calls
    from specc.serving.schemas import ChatCompletionRequest

    tools = plan_tools(ChatCompletionRequest.model_validate({k: v for k, v in kw.items() if k != "model"}), model.tokenizer)
    ids = model.tokenizer(model.tokenizer.apply_chat_template(MESSAGES, tools=tools.tools, add_generation_prompt=True,
                                                              tokenize=False), add_special_tokens=False)["input_ids"]
    alone = model.generate([ids], max_new_tokens=120, structural_tag=tools.tag, speculative=False)[0]
    message = ChoiceCalls(tools.format).message(alone.text)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == whole[0]["calls"]


def test_required_never_yields_an_unparseable_call_over_a_fuzz_corpus(served):
    """Each schema alone and all of them (20 tools in one request): every call parses and validates (one call per
    reply, so that a random model's reply ends within max_tokens)."""
    s, _ = served
    client = s.client()
    many = [_tool(f"t{i}", FUZZ[i % len(FUZZ)]) for i in range(20)]
    requests = [[_tool("only", schema)] for schema in FUZZ] + [many]
    for tools in requests:
        for stream in (False, True):
            kw = dict(model="tiny", messages=MESSAGES, tools=tools, tool_choice="required", parallel_tool_calls=False,
                      max_tokens=300, temperature=0)
            got = _streamed(client.chat.completions.create(stream=True, **kw)) if stream else \
                _whole(client.chat.completions.create(**kw).choices)
            assert got[0]["finish"] == "tool_calls" and got[0]["calls"], got
            names = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in tools}
            _valid(got[0]["calls"], names)


def test_history_with_calls_and_results_is_rendered_by_the_template(served):
    s, model = served
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    r = s.client().chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=4, temperature=0)
    rendered = model.tokenizer.apply_chat_template(
        [history[0], {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
         {"role": "tool", "content": "5", "tool_call_id": "call_1"}],
        tools=[{"type": "function", "function": t["function"]} for t in TOOLS], add_generation_prompt=True, tokenize=False)
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' in rendered
    assert r.usage.prompt_tokens == len(model.tokenizer(rendered, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("change, param", [
    ({"tool_choice": "required", "tools": None}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [_tool("add", ADD), _tool("add", ADD)]}, "tools.1.function.name"),
    ({"tools": [_tool("bad name", ADD)]}, "tools.0.function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"tools": [_tool("s", {"type": "string"})]}, "tools.0.function.parameters"),
    ({"tools": [_tool("add", ADD), _tool("x", {"type": "object", "properties": {"a": {"type": "integer", "minimum": "z"}}})],
      "tool_choice": "required"}, "tools.1.function.parameters"),
    ({"tools": [_tool(f"t{i}", ADD) for i in range(129)]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                        "function": {"name": "add", "arguments": "{a: 1}"}}]}]},
     "messages.0.tool_calls.0.function.arguments"),
    ({"functions": [{"name": "add"}]}, "functions"),
    ({"messages": [{"role": "assistant", "function_call": {"name": "add", "arguments": "{}"}}]}, "messages.0.function_call"),
])
def test_bad_tool_requests_are_400s_naming_the_field(served, change, param):
    s, _ = served
    body = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 3, **change}
    r = s.post("/v1/chat/completions", {k: v for k, v in body.items() if v is not None})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_tools_on_completions_are_refused(served):
    s, _ = served
    r = s.post("/v1/completions", {"model": "tiny", "prompt": "hi", "tools": TOOLS})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


@pytest.mark.parametrize("template, code", [(PLAIN, "template_without_tools"), (UNKNOWN_FORMAT, "tool_format_unknown")])
def test_templates_that_cannot_carry_tools_are_refused_naming_chat_template(served, template, code):
    s, model = served
    from specc.serving.app import create_app
    from test_serving import Server

    other = specc.load(model.bundle.path)
    other.set_chat_template(template)
    server = Server(create_app(other, name="tiny"))
    try:
        r = server.post("/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 3})
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == code and "--chat-template" in err["message"], err
    finally:
        server.stop()


def test_a_schema_that_cannot_compile_is_a_quick_400_beside_a_running_stream(served):
    s, _ = served
    client = s.client()
    done = {}

    def stream():
        chunks = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                                max_tokens=120, temperature=0, stream=True)
        done["calls"] = _streamed(chunks)[0]["calls"]

    thread = threading.Thread(target=stream)
    thread.start()
    bad = [_tool("x", {"type": "object", "properties": {"a": {"type": "integer", "minimum": "z"}}})]
    r = s.post("/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "tools": bad, "tool_choice": "required"})
    assert r.status_code == 400 and "'x'" in r.json()["error"]["message"]
    thread.join(120)
    assert done["calls"]


# -- with issue 57: tool grammars go the schemas' way -----------------------------------------------------
@pytest.mark.parametrize("schema, keyword", [
    ({"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 2}}}, "multipleOf"),
    ({"type": "object", "properties": {"l": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}},
     "uniqueItems"),
    ({"type": "object", "properties": {"v": {"oneOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                                                      {"type": "object", "properties": {"b": {"type": "integer"}}}]}}},
     "oneOf"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}, "required"),
])
def test_tool_schemas_are_checked_as_json_schemas_are_naming_the_tool_and_keyword(served, schema, keyword):
    """A keyword the grammar cannot enforce in a tool the model may call is a 400 naming the tool's parameters
    and the keyword; a tool the choice never lets it call ("none", another named tool) is only rendered."""
    s, _ = served
    tools = TOOLS + [_tool("x", schema)]
    for choice in ("required", "auto", {"type": "function", "function": {"name": "x"}}):
        r = s.post("/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "tools": tools,
                                            "tool_choice": choice, "max_tokens": 3})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "tools.2.function.parameters", r.text
        assert keyword in err["message"] and "'x'" in err["message"], err
    for choice in ("none", {"type": "function", "function": {"name": "add"}}):
        r = s.post("/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "tools": tools,
                                            "tool_choice": choice, "max_tokens": 3})
        assert r.status_code == 200, r.text


def test_tool_grammars_compile_on_the_grammar_thread_never_the_engines(served, monkeypatch):
    """The structural tag compiles in the request's worker thread through the grammar thread (timeout, cache),
    travels in Rules.grammar, and the engine thread compiles nothing."""
    from specc.runtime.grammar import TAG_KEY, Grammars

    s, _ = served
    seen: list[tuple[str, str]] = []
    for method in ("compile", "compile_tag", "_build"):
        real = getattr(Grammars, method)

        def spy(self, key, *a, _real=real, _method=method, **kw):
            seen.append((_method if not key.startswith(TAG_KEY) else "_build_tag", threading.current_thread().name))
            return _real(self, key, *a, **kw)

        monkeypatch.setattr(Grammars, method, spy)
    tools = [_tool("fresh_tool", {"type": "object", "properties": {"q": {"type": "integer", "minimum": 0,
                                                                            "maximum": 7}}, "required": ["q"]})]
    for stream in (False, True):
        kw = dict(model="tiny", messages=MESSAGES, tools=tools, tool_choice="required", max_tokens=120, temperature=0)
        got = _streamed(s.client().chat.completions.create(stream=True, **kw)) if stream else \
            _whole(s.client().chat.completions.create(**kw).choices)
        assert got[0]["calls"] and got[0]["calls"][0][0] == "fresh_tool", got
    assert [n for m, n in seen if m == "_build_tag"] == ["specc-grammar_0"], seen  # compiled once, then cached
    assert [m for m, _ in seen].count("compile_tag") == 2 and not any(n == "specc-engine" for _, n in seen), seen


def test_compiling_a_tag_waits_at_most_the_timeout_and_caches(served, monkeypatch):
    import time

    from specc.errors import RequestError
    from specc.runtime import grammar
    from specc.serving.tool_formats import FORMATS, structural_tag

    _, model = served
    tag = structural_tag(FORMATS[0], [("add_slowly", grammar.schema_ebnf(json.dumps(ADD)))], "add_slowly", False)
    real, calls = grammar.Grammars._compile_tag, []

    def slow(self, text):
        calls.append(text)
        time.sleep(1.0)
        return real(self, text)

    monkeypatch.setattr(grammar.Grammars, "_compile_tag", slow)
    start = time.perf_counter()
    with pytest.raises(RequestError, match="structural_tag took longer than 0.2 s"):
        model.grammars.compile_tag(tag, timeout=0.2)
    assert time.perf_counter() - start < 0.8
    time.sleep(1.2)  # the compile finished in the background: cached
    first = model.grammars.compile_tag(tag, timeout=0.2)
    assert model.rules(structural_tag=tag).grammar is first and len(calls) == 1
    with pytest.raises(RequestError, match="^structural_tag could not be compiled"):
        model.grammars.compile_tag('{"type": "structural_tag", "format": {"type": "nonsense"}}')


def test_a_tool_grammar_dead_end_fails_its_own_request_naming_tools(served):
    """RowRule.commit reports a refused token of a tool grammar as the structural tag's (not the schema's), and the
    server answers it with param tools."""
    from specc.errors import UnsatisfiableOutputError
    from specc.runtime.rules import RowRule
    from specc.serving.row_failures import request_failed
    from test_tools import _tags

    _, model = served
    rules = model.rules(structural_tag=_tags()["required"])
    rule = RowRule(rules, [1, 2], model.target.dims.vocab_size, model.grammars.tag_matcher(rules.structural_tag,
                                                                                           rules.grammar))
    x = model.tokenizer("x", add_special_tokens=False)["input_ids"][0]  # a call must open with "<tool_call>"
    failure = rule.commit([x])
    assert isinstance(failure, UnsatisfiableOutputError) and failure.field == "structural_tag", failure
    error = request_failed(failure)
    assert error.status == 400 and error.body()["error"]["param"] == "tools"


# -- an agent framework on loopback ---------------------------------------------------------------------
def _agent_run(url: str, model_name: str, stream: bool, choice: str, max_tokens: int):
    """The OpenAI Agents SDK: an agent with two tools; it calls one, gets its result, and goes on to an answer."""
    import asyncio

    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    seen: list[tuple[str, dict]] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Tokyo", "Lima"]) -> str:
        """The weather in a city."""
        seen.append(("get_weather", {"city": city}))
        return json.dumps({"city": city, "celsius": 21})

    @agents.function_tool
    def add(a: Literal[1, 2, 3], b: Literal[1, 2, 3]) -> int:
        """Add two small numbers."""
        seen.append(("add", {"a": a, "b": b}))
        return a + b

    client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    agent = agents.Agent(name="helper", instructions="Use the tools.", tools=[get_weather, add],
                         model=agents.OpenAIChatCompletionsModel(model=model_name, openai_client=client),
                         model_settings=agents.ModelSettings(tool_choice=choice, temperature=0, max_tokens=max_tokens,
                                                             parallel_tool_calls=False))

    async def run():
        prompt = "What is the weather in Paris, and what is 2 + 3?"
        if not stream:
            return await agents.Runner.run(agent, prompt, max_turns=6)
        result = agents.Runner.run_streamed(agent, prompt, max_turns=6)
        async for _ in result.stream_events():
            pass
        return result

    result = asyncio.run(run())
    return result, seen


def test_an_agent_framework_loop_runs_against_specc_serve(served):
    """The first turn must call a tool (required), the SDK runs it and feeds the result back, then the model answers;
    streamed and non-streamed runs agree."""
    s, _ = served
    runs = [_agent_run(s.url, "tiny", stream, "required", 120) for stream in (False, True)]
    for result, seen in runs:
        assert seen and len(result.raw_responses) >= 2
        assert isinstance(result.final_output, str)
    assert runs[0][1] == runs[1][1] and runs[0][0].final_output == runs[1][0].final_output


@pytest.mark.real_model
@pytest.mark.heavy
def test_an_agent_loop_on_a_catalog_model(tmp_path_factory):
    """Qwen2.5-Coder-0.5B-Instruct (its own template, <tool_call>), prompt lookup with k auto: the agent's calls
    parse and validate, the tools' results come back, streamed and non-streamed runs agree."""
    from specc.compiler import compile_recipe
    from specc.recipe import parse_recipe
    from specc.serving.app import create_app
    from test_serving import Server

    recipe = parse_recipe({"target": {"model": "qwen2.5-coder-0.5b-instruct"},
                           "draft": {"method": "prompt_lookup", "max_ngram": 3}, "speculation": {"k": "auto"},
                           "limits": {"max_batch": 4, "max_context": 2048}})
    bundle = compile_recipe(recipe, output=tmp_path_factory.mktemp("qwen") / "bundle", progress=False)
    server = Server(create_app(specc.load(bundle), name="qwen"))
    try:
        runs = [_agent_run(server.url, "qwen", stream, "required", 200) for stream in (False, True)]
    finally:
        server.stop()
    for result, seen in runs:
        assert seen and len(result.raw_responses) >= 2, seen
    assert runs[0][1] == runs[1][1] and runs[0][0].final_output == runs[1][0].final_output
