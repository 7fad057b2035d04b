"""/v1/responses over the real app and a scripted engine: the official openai client's
responses.create(...) and stream=True parse what is sent (text, function calls, reasoning);
stateful fields are refused; vLLM's endpoints for other model kinds answer 404 saying why."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from openai import OpenAI
from reasoning_cases import CASES, resolve
from shoal.engine.entrypoints.api_server import build_app
from shoal.engine.entrypoints.tool_calls import ToolSettings
from test_chat_fields_reasoning import ThinkEngine, _ids, think_model  # noqa: F401

WEATHER = {"type": "function", "name": "weather", "description": "the weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


@pytest.fixture
def app(think_model):  # noqa: F811
    engine = ThinkEngine(think_model)

    def client(**settings) -> tuple[TestClient, OpenAI]:
        c = TestClient(build_app(engine, served_model_names=["tiny"],
                                 tool_settings=ToolSettings(**settings)))
        return c, OpenAI(base_url="http://testserver/v1", api_key="x", http_client=c)

    return engine, client


def test_text_in_and_out(app):
    engine, client = app
    engine.script = [("Hel", [5]), ("lo", [6])]
    _, oa = client()
    r = oa.responses.create(model="tiny", input="hi", instructions="be brief",
                            max_output_tokens=20)
    assert r.status == "completed" and r.output_text == "Hello"
    assert r.usage.output_tokens == 2 and r.id.startswith("resp_")
    prompt = engine.tokenizer.decode(engine.asked[-1][0])
    assert "be brief" in prompt and "hi" in prompt
    assert engine.asked[-1][1].max_tokens == 20


def test_streamed_text_events_parse_in_order(app):
    engine, client = app
    engine.script = [("Hel", [5]), ("lo", [6])]
    _, oa = client()
    events = list(oa.responses.create(model="tiny", input="hi", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output_text == "Hello"
    assert "response.output_item.done" in kinds and "response.content_part.done" in kinds


def test_function_calls_whole_and_streamed(app):
    engine, client = app
    call = '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
    engine.script = [(call[:20], [5]), (call[20:], [6])]
    _, oa = client(enable_auto_tool_choice=True, tool_call_parser="hermes")
    r = oa.responses.create(model="tiny", input="weather?", tools=[WEATHER])
    (item,) = r.output
    assert item.type == "function_call" and item.name == "weather"
    assert json.loads(item.arguments) == {"city": "Oslo"}
    events = list(oa.responses.create(model="tiny", input="weather?", tools=[WEATHER],
                                      stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments) == {"city": "Oslo"}
    assert events[-1].response.output[0].type == "function_call"
    # the call and its output replayed as input reach the template as tool messages
    oa.responses.create(model="tiny", tools=[WEATHER], input=[
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": "c1", "name": "weather",
         "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}])
    assert "sunny" in engine.tokenizer.decode(engine.asked[-1][0])


def test_reasoning_items(app):
    engine, client = app
    engine.script = resolve(CASES[0], *_ids(engine))
    _, oa = client(reasoning_parser="deepseek_r1")
    r = oa.responses.create(model="tiny", input="q")
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "abc" and r.output_text == "\n\nhi"
    events = list(oa.responses.create(model="tiny", input="q", stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") \
        == "abc"


def test_cut_by_max_output_tokens_is_incomplete(app):
    engine, client = app
    engine.script = [("a", [5])]

    async def cut(ids, params, request_id, priority=0, lora=None):
        from shoal.engine.frontend.output_processor import RequestOutput
        yield RequestOutput(request_id, "a", [5], len(ids), 1, finish_reason="length")

    engine.generate = cut
    _, oa = client()
    r = oa.responses.create(model="tiny", input="q", max_output_tokens=1)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize("extra, says", [
    ({"store": True}, "stateless"),
    ({"previous_response_id": "resp_1"}, "stateless"),
    ({"background": True}, "stateless"),
    ({"frobnicate": 1}, "frobnicate"),
])
def test_stateful_and_unknown_fields_are_refused(app, extra, says):
    _, client = app
    c, _ = client()
    r = c.post("/v1/responses", json={"input": "q", **extra})
    assert r.status_code == 400 and says in r.json()["error"]["message"]
    assert c.post("/v1/responses", json={"input": "q", "store": False}).status_code == 200


@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/rerank", "/v1/audio/transcriptions",
                                  "/pooling", "/score"])
def test_other_model_kinds_answer_404_saying_text_only(app, path):
    _, client = app
    c, _ = client()
    r = c.post(path, json={})
    assert r.status_code == 404 and "generates text only" in r.json()["error"]["message"]
