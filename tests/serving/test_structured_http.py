"""Structured output and tool calling over HTTP, through the official openai client, on one
server started with `--enable-auto-tool-choice --tool-call-parser hermes`. The random-weight
model writes garbage, but the grammar guarantees the shapes; schemas are bounded so outputs end
before max_tokens."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from shoal.engine.entrypoints.protocol import ChatCompletionRequest
from shoal.engine.entrypoints.tool_calls import ToolSettings, plan_tools
from shoal.engine.entrypoints.tool_parsers import ToolCallStream, parse_hermes, scan_required
from shoal.engine.errors import InvalidRequestError
from support.servers import MODEL_NAME, healthy_server

pytestmark = pytest.mark.process

MESSAGES = [{"role": "user", "content": "What is the weather?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "y": {"type": "boolean"}},
       "required": ["x", "y"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    with healthy_server(tiny_model, tmp_path_factory, "--enable-auto-tool-choice",
                        "--tool-call-parser", "hermes") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def chat(client, **kw):
    kw.setdefault("max_tokens", 120)
    return client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **kw)


# ----- structured output ----------------------------------------------------------------------


def test_response_format_json_schema_output_validates(client):
    r = chat(client, n=3, temperature=1.0, seed=7, response_format={
        "type": "json_schema",
        "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}})
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), WEATHER)


def test_guided_choice_and_regex_over_completions_and_chat(client):
    r = client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=20, n=4, seed=1,
                                  temperature=1.0, extra_body={"guided_choice": ["up", "down"]})
    assert {c.text for c in r.choices} <= {"up", "down"}
    r = chat(client, n=4, seed=2, temperature=1.0,
             extra_body={"structured_outputs": {"regex": r"[a-f]{3}\d"}})
    assert all(re.fullmatch(r"[a-f]{3}\d", c.message.content) for c in r.choices)


@pytest.mark.parametrize("extra, field", [
    ({"guided_regex": "a["}, "guided_regex"),
    ({"guided_json": {"type": "strin"}}, "guided_json"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "a", "structural_tag": "x"}}, "structural_tag"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "only one structured output field"),
])
def test_a_bad_constraint_is_a_400_naming_the_field(client, extra, field):
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, max_tokens=4, extra_body=extra)
    assert field in err.value.message


# ----- tool calls -----------------------------------------------------------------------------


def check_calls(calls, names=SCHEMAS):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), names[call.function.name])


def test_tool_choice_required_returns_calls_that_satisfy_their_schemas(client):
    r = chat(client, n=4, seed=3, temperature=1.0, tools=TOOLS, tool_choice="required",
             parallel_tool_calls=False)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice.message
        assert len(choice.message.tool_calls) == 1
        check_calls(choice.message.tool_calls)


def test_a_named_tool_choice_calls_that_function(client):
    r = chat(client, n=3, seed=4, temperature=1.0, tools=TOOLS,
             tool_choice={"type": "function", "function": {"name": "add"}})
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        assert [c.function.name for c in choice.message.tool_calls] == ["add"]
        check_calls(choice.message.tool_calls)


def test_streamed_tool_calls_arrive_as_openai_deltas(client):
    stream = chat(client, seed=5, temperature=1.0, tools=TOOLS, tool_choice="required",
                  stream=True)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        delta = chunk.choices[0].delta
        for tc in delta.tool_calls or []:
            if tc.index not in calls:  # the first delta of a call: id, type, name, ""
                assert tc.id and tc.type == "function" and tc.function.name
                assert tc.function.arguments == ""
                calls[tc.index] = {"name": tc.function.name, "arguments": ""}
            else:
                assert tc.id is None and tc.function.name is None
                calls[tc.index]["arguments"] += tc.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and calls
    assert sorted(calls) == list(range(len(calls)))
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_history_with_tool_calls_and_tool_results_is_accepted(client):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "add", "arguments": '{"x":1,"y":true}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "2"}]
    r = client.chat.completions.create(model=MODEL_NAME, messages=history, max_tokens=4,
                                       tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason in ("stop", "length")


def test_auto_tool_choice_with_the_hermes_parser_answers_text(client):
    # The random model does not write <tool_call> blocks: the answer is plain content.
    r = chat(client, max_tokens=8, tools=TOOLS)  # tool_choice defaults to "auto"
    assert r.choices[0].message.content is not None


@pytest.mark.parametrize("kw, field", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools[0].type"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
    ({"tool_choice": "required", "logprobs": True}, "logprobs and prompt_logprobs are not"),
])
def test_bad_tool_requests_are_400s_naming_the_field(client, kw, field):
    kw.setdefault("tools", TOOLS)
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, max_tokens=4, **kw)
    assert field in err.value.message


def test_auto_is_refused_without_the_server_flags():
    body = ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": TOOLS})
    with pytest.raises(InvalidRequestError, match="--enable-auto-tool-choice"):
        plan_tools(body, ToolSettings())
    assert plan_tools(body, ToolSettings(True, "hermes")).mode == "auto"


# ----- the parsers on their own ---------------------------------------------------------------


def test_hermes_parser_reads_calls_and_content():
    text = ('Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
            '</tool_call><tool_call>{"name": "add", "arguments": {"x": 1}}</tool_call>')
    content, calls = parse_hermes(text)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("add", {"x": 1})]


@pytest.mark.parametrize("mode, text", [
    ("auto", 'Hi <tool_call>{"name": "add", "arguments": {"x": 1, "y": true}}</tool_call>'),
    ("required", '[{"name":"add","parameters":{"x":1,"y":true}},'
                 '{"name":"get_weather","parameters":{"city":"a}\\"b","unit":"c"}}]'),
])
def test_streaming_one_character_at_a_time_rebuilds_the_calls(mode, text):
    body = ChatCompletionRequest.model_validate(
        {"messages": MESSAGES, "tools": TOOLS, "tool_choice": mode})
    stream = ToolCallStream(plan_tools(body, ToolSettings(True, "hermes")))
    content, calls = "", {}
    for i, ch in enumerate(text):
        for delta in stream.feed(ch, final=i == len(text) - 1):
            content += delta.get("content", "")
            for tc in delta.get("tool_calls", []):
                call = calls.setdefault(tc["index"], {"name": tc["function"].get("name"),
                                                      "arguments": ""})
                call["arguments"] += tc["function"]["arguments"]
    expected = (scan_required(text) if mode == "required" else parse_hermes(text)[1])
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (c.name, json.loads(c.arguments)) for c in expected]
    assert content == ("Hi " if mode == "auto" else "")
