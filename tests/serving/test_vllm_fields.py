"""What vLLM's clients, peer routers and load testers send is answered as vLLM answers it, in
process (no engine): the real `build_app` over a scripted engine that records what it was asked
(SamplingParams, prompt tokens) and answers a fixed run of tokens.

Issue 24's silent defects on the HTTP side: VLLM_API_KEY and several --api-key keys; the
model's generation_config defaults below a request's own values; chat return_token_ids;
max_completion_tokens over max_tokens; text parts joined by a newline; tool_choice "none" keeping
the tools in the template; /tokenize's add_special_tokens with messages; tool grammars closed to
the declared properties and a forced call cut by max_tokens; the fields routers inject at "off";
continuous_usage_stats; null as absent; /ping and /invocations."""

from __future__ import annotations

import json
import types

import pytest
from fastapi.testclient import TestClient
from shoal.contract.auth import api_keys
from shoal.engine.entrypoints.api_server import build_app
from shoal.engine.entrypoints.serve_flags import build_parser
from shoal.engine.entrypoints.tool_calls import closed_objects
from shoal.engine.frontend.input_processor import InputProcessor
from shoal.engine.frontend.metrics import FrontendMetrics
from shoal.engine.frontend.output_processor import OutputProcessor, RequestOutput
from shoal.engine.tokenizer import load_tokenizer

KEYS = ["old-key", "new-key"]
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


class ScriptedEngine:
    """AsyncLLM's surface for the HTTP layer; `generate` answers `text` one character per token
    (token id 100 + i) up to max_tokens, and records each request."""

    def __init__(self, model: str) -> None:
        self.tokenizer = load_tokenizer(model)
        self.config = types.SimpleNamespace(model=model, max_logprobs=20)
        self.max_model_len = 512
        self.input_processor = InputProcessor(self.tokenizer, max_model_len=512,
                                              vocab_size=len(self.tokenizer))
        self.output_processor = OutputProcessor(self.tokenizer)
        self.metrics = FrontendMetrics("tiny")
        self.dead_error, self.is_healthy = None, True
        self.text = "abcdef"
        self.asked: list[tuple[list[int], object]] = []
        self.priorities: list[int] = []
        self.cached = 0  # prompt tokens each request reports served from the prefix cache

    def _check_available(self) -> None:
        pass

    async def generate(self, ids, params, request_id, priority=0, lora=None):
        self.asked.append((list(ids), params))
        self.priorities.append(priority)
        n = len(self.text) if params.max_tokens is None else min(len(self.text),
                                                                 params.max_tokens)
        for i in range(n):
            last = i == n - 1
            finish = ("length" if n < len(self.text) else "stop") if last else None
            yield RequestOutput(request_id, self.text[i], [100 + i], len(ids), i + 1,
                                num_cached_tokens=self.cached, finish_reason=finish)


@pytest.fixture
def served(tiny_model):
    engine = ScriptedEngine(tiny_model)

    def client(**app_args) -> TestClient:
        return TestClient(build_app(engine, served_model_names=["tiny"], **app_args))

    return engine, client


def _sse(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines()
            if line.startswith("data: {")]


# ----- API keys ---------------------------------------------------------------------------


@pytest.mark.parametrize("flag, env, keys", [
    (None, {"VLLM_API_KEY": "v"}, ["v"]),  # a vLLM manifest's key: never served open
    (None, {"SHOAL_API_KEY": "s", "VLLM_API_KEY": "v"}, ["s", "v"]),
    (["a", "b"], {"VLLM_API_KEY": "v"}, ["a", "b"]),  # the flag wins, as in vLLM
    (None, {"VLLM_API_KEY": ""}, []),
    (None, {}, []),
])
def test_the_accepted_keys_come_from_the_flag_else_both_variables(flag, env, keys):
    assert api_keys(flag, env) == keys


def test_api_key_takes_several_keys_and_each_is_accepted(served):
    args = build_parser().parse_args(["m", "--api-key", *KEYS])
    assert args.api_key == KEYS
    _, client = served
    c = client(api_keys=api_keys(args.api_key, {}))
    for key in KEYS:
        assert c.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    assert c.get("/v1/models", headers={"Authorization": "bearer new-key"}).status_code == 200
    for bad in ({}, {"Authorization": "Bearer other"}, {"Authorization": "Basic old-key"}):
        assert c.get("/v1/models", headers=bad).status_code == 401


# ----- sampling values ----------------------------------------------------------------------


def test_generation_config_defaults_apply_below_the_requests_own_values(served):
    engine, client = served
    c = client(sampling_defaults={"temperature": 0.6, "top_k": 20, "max_tokens": 3})
    assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
    p = engine.asked[-1][1]
    assert (p.temperature, p.top_k, p.max_tokens) == (0.6, 20, 3)
    c.post("/v1/chat/completions", json={**CHAT, "temperature": 1.0, "max_tokens": 5})
    p = engine.asked[-1][1]
    assert (p.temperature, p.top_k, p.max_tokens) == (1.0, 20, 5)
    c.post("/v1/completions", json={"prompt": "x", "top_k": 4})
    p = engine.asked[-1][1]
    assert (p.temperature, p.top_k, p.max_tokens) == (0.6, 4, 16)  # completions' own 16


def test_max_completion_tokens_wins_over_max_tokens(served):
    engine, client = served
    client().post("/v1/chat/completions",
                  json={**CHAT, "max_tokens": 5, "max_completion_tokens": 2})
    assert engine.asked[-1][1].max_tokens == 2


def test_text_parts_are_joined_with_a_newline(served):
    engine, client = served
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    client().post("/v1/chat/completions",
                  json={"messages": [{"role": "user", "content": parts}]})
    expected = engine.input_processor.render_chat(
        [{"role": "user", "content": "first\nsecond"}])
    assert engine.asked[-1][0] == expected


def test_tokenize_with_messages_honours_add_special_tokens(served):
    engine, client = served
    c = client()
    plain = c.post("/tokenize", json=CHAT).json()["tokens"]
    with_bos = c.post("/tokenize", json={**CHAT, "add_special_tokens": True}).json()["tokens"]
    bos = engine.tokenizer("x").input_ids[0]
    assert plain[0] != bos and with_bos == [bos, *plain]
    assert c.post("/tokenize", json={"prompt": "x"}).json()["tokens"][0] == bos
    # vllm-router tokenizes every chat with continue_final_message: false; true is refused.
    assert c.post("/tokenize", json={**CHAT, "continue_final_message": False}).json()[
        "tokens"] == plain
    r = c.post("/tokenize", json={**CHAT, "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


# ----- return_token_ids and usage ----------------------------------------------------------


def test_chat_return_token_ids_has_vllms_shape(served):
    engine, client = served
    c = client()
    r = c.post("/v1/chat/completions", json={**CHAT, "return_token_ids": True}).json()
    assert r["prompt_token_ids"] == engine.asked[-1][0]
    assert r["choices"][0]["token_ids"] == [100, 101, 102, 103, 104, 105]
    chunks = _sse(c.post("/v1/chat/completions",
                         json={**CHAT, "return_token_ids": True, "stream": True}).text)
    assert chunks[0]["prompt_token_ids"] == engine.asked[-1][0]
    assert [t for ch in chunks[1:] for t in ch["choices"][0]["token_ids"]] == list(
        range(100, 106))


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT),
                                        ("/v1/completions", {"prompt": "x"})])
def test_continuous_usage_stats_put_usage_in_every_chunk(served, path, body):
    engine, client = served
    chunks = _sse(client().post(path, json={**body, "stream": True, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}}).text)
    n_prompt = len(engine.asked[-1][0])
    assert all("usage" in ch for ch in chunks)
    per_chunk = [ch["usage"]["completion_tokens"] for ch in chunks if ch["choices"]]
    assert per_chunk == sorted(per_chunk) and per_chunk[-1] == 6
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": n_prompt, "completion_tokens": 6, "total_tokens": n_prompt + 6}


# ----- what routers and clients inject ------------------------------------------------------


ROUTER_FIELDS = {"no_stop_trim": False, "return_hidden_states": False}
CHAT_ROUTER_FIELDS = {**ROUTER_FIELDS, "continue_final_message": False,
                      "separate_reasoning": True, "stream_reasoning": True,
                      "include_reasoning": True}
HINTS = {"user": "u1", "prompt_cache_key": "conv-7", "safety_identifier": "h",
         "metadata": {"a": "b"}, "store": False, "service_tier": "auto"}
NULLS = {"n": None, "stream": None, "temperature": None, "stop": None, "stream_options": None,
         "logprobs": None, "seed": None}


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {**CHAT, **CHAT_ROUTER_FIELDS, **HINTS, **NULLS}),
    ("/v1/completions", {"prompt": "x", **ROUTER_FIELDS, **HINTS, **NULLS, "echo": None}),
])
def test_router_defaults_hints_and_nulls_are_accepted(served, path, body):
    _, client = served
    r = client().post(path, json=body)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path, field, value", [
    ("/v1/chat/completions", "continue_final_message", True),
    ("/v1/chat/completions", "include_reasoning", False),
    ("/v1/completions", "no_stop_trim", True),
    ("/v1/completions", "return_hidden_states", True),
    ("/v1/chat/completions", "store", True),
])
def test_a_value_that_would_change_the_answer_is_still_a_400_naming_it(served, path, field,
                                                                        value):
    _, client = served
    body = {**(CHAT if "chat" in path else {"prompt": "x"}), field: value}
    r = client().post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


# ----- tools --------------------------------------------------------------------------------


WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "where": {
        "type": "object", "properties": {"lat": {"type": "number"}}}}}}}


@pytest.mark.parametrize("schema, closed", [
    ({"type": "object", "properties": {"a": {"type": "string"}}},
     {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": False}),
    ({"type": "object", "properties": {"a": {}}, "additionalProperties": True},
     {"type": "object", "properties": {"a": {}}, "additionalProperties": True}),  # as said
    ({"type": "object"}, {"type": "object"}),  # no properties declared: any object
    ({"type": "array", "items": {"properties": {"b": {}}}},
     {"type": "array", "items": {"properties": {"b": {}}, "additionalProperties": False}}),
    ({"anyOf": [{"properties": {"c": {}}}], "$defs": {"d": {"properties": {"e": {}}}}},
     {"anyOf": [{"properties": {"c": {}}, "additionalProperties": False}],
      "$defs": {"d": {"properties": {"e": {}}, "additionalProperties": False}}}),
    ({"allOf": [{"properties": {"f": {}}}], "properties": {"g": {}}},
     {"allOf": [{"properties": {"f": {}}}], "properties": {"g": {}}}),  # composed: left open
])
def test_tool_schemas_are_closed_to_their_declared_properties(schema, closed):
    assert closed_objects(schema) == closed


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "weather"}}])
def test_a_forced_calls_grammar_allows_no_undeclared_key(served, choice):
    engine, client = served
    engine.text = '[{"name":"weather","parameters":{"city":"Paris"}}]' if choice == "required" \
        else '{"city":"Paris"}'
    r = client().post("/v1/chat/completions",
                      json={**CHAT, "tools": [WEATHER], "tool_choice": choice})
    assert r.status_code == 200, r.text
    spec = json.loads(engine.asked[-1][1].structured_outputs.spec)
    params = (spec["items"]["properties"]["parameters"] if choice == "required" else spec)
    assert params["additionalProperties"] is False
    assert params["properties"]["where"]["additionalProperties"] is False
    assert r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "weather"


def test_a_required_call_cut_by_max_tokens_is_a_cut_call_not_text(served):
    engine, client = served
    engine.text = '[{"name":"weather","parameters":{"city":"Paris, France"}}]'
    cut = engine.text.index("Paris") + 3  # max_tokens ends it inside the arguments
    r = client().post("/v1/chat/completions", json={**CHAT, "tools": [WEATHER],
                                                    "tool_choice": "required",
                                                    "max_tokens": cut}).json()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    call = choice["message"]["tool_calls"][0]["function"]
    assert call["name"] == "weather" and call["arguments"] == '{"city":"Par'


def test_tool_choice_none_keeps_the_tools_in_the_template(served, monkeypatch):
    engine, client = served
    seen = []
    render = engine.input_processor.render_chat
    monkeypatch.setattr(engine.input_processor, "render_chat",
                        lambda *a, **k: seen.append(k.get("tools")) or render(*a, **k))
    r = client().post("/v1/chat/completions",
                      json={**CHAT, "tools": [WEATHER], "tool_choice": "none"})
    assert r.status_code == 200 and "tool_calls" not in r.json()["choices"][0]["message"]
    assert seen == [[WEATHER]]


# ----- SageMaker's routes -------------------------------------------------------------------


def test_ping_is_health_and_invocations_route_by_the_body(served):
    engine, client = served
    c = client(api_keys=KEYS)  # neither is under /v1: no key, as in vLLM
    assert c.get("/ping").status_code == 200 and c.post("/ping").status_code == 200
    chat = c.post("/invocations", json=CHAT).json()
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["content"] == "abcdef"
    done = c.post("/invocations", json={"prompt": "x", "max_tokens": 2}).json()
    assert done["object"] == "text_completion" and done["choices"][0]["text"] == "ab"
    bad = c.post("/invocations", json={"input": "x"})
    assert bad.status_code == 400 and "messages" in bad.json()["error"]["message"]
    unknown = c.post("/invocations", json={**CHAT, "suffix_x": 1})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "suffix_x"
    engine.is_healthy = False
    try:
        assert c.get("/ping").status_code == 503
    finally:
        engine.is_healthy = True


# ----- priority (--scheduling-policy) ---------------------------------------------------


PRIORITY_BODIES = [("/v1/completions", {"prompt": "a", "max_tokens": 2}),
                   ("/v1/chat/completions", {**CHAT, "max_tokens": 2}),
                   ("/v1/responses", {"input": "a", "max_output_tokens": 2})]


@pytest.mark.parametrize("path, body", PRIORITY_BODIES, ids=lambda x: str(x)[:20])
def test_a_priority_under_fcfs_is_a_400_in_vllms_words(served, path, body):
    engine, client = served
    http = client()
    r = http.post(path, json={**body, "priority": 5})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == (
        "Got priority 5 but Priority scheduling is not enabled.")
    r = http.post(path, json=body, headers={"X-Vllm-Priority": "-1"})  # vLLM's header too
    assert r.status_code == 400 and "Got priority -1 " in r.json()["error"]["message"]
    assert engine.priorities == []  # nothing reached the engine
    assert http.post(path, json={**body, "priority": 0}).status_code == 200


@pytest.mark.parametrize("path, body", PRIORITY_BODIES, ids=lambda x: str(x)[:20])
def test_priority_reaches_the_engine_under_the_priority_policy(served, path, body):
    engine, client = served
    engine.input_processor.scheduling_policy = "priority"
    http = client()
    assert http.post(path, json={**body, "priority": -3}).status_code == 200
    # the header wins when it is an integer, as vLLM's _get_priority reads it
    assert http.post(path, json={**body, "priority": 1},
                     headers={"X-Vllm-Priority": "7"}).status_code == 200
    assert http.post(path, json={**body, "priority": 2},
                     headers={"X-Vllm-Priority": "high"}).status_code == 200
    assert engine.priorities == [-3, 7, 2]


def test_a_priority_outside_int64_is_a_400_naming_it(served):
    _, client = served
    r = client().post("/v1/completions", json={"prompt": "a", "priority": 2**63})
    assert r.status_code == 400 and "priority" in r.json()["error"]["message"]


# ----- --enable-prompt-tokens-details ----------------------------------------------------


def _usages(r) -> list[dict]:
    if r.headers["content-type"].startswith("text/event-stream"):
        return [c["usage"] for c in _sse(r.text) if c.get("usage")]
    return [r.json()["usage"]]


@pytest.mark.parametrize("path, body", PRIORITY_BODIES[:2], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("enabled", [False, True])
def test_prompt_tokens_details_carry_the_cached_tokens_with_the_flag(served, path, body, stream,
                                                                     enabled):
    from shoal.engine.entrypoints.serving import OutputSettings

    engine, client = served
    engine.cached = 16
    http = client(output=OutputSettings(enable_prompt_tokens_details=enabled))
    if stream:
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    (u,) = _usages(http.post(path, json=body))
    if enabled:
        assert u["prompt_tokens_details"] == {"cached_tokens": 16}
    else:
        assert "prompt_tokens_details" not in u  # vLLM's default: absent


def test_responses_report_the_cached_tokens_always(served):
    engine, client = served
    engine.cached = 32
    r = client().post("/v1/responses", json={"input": "a", "max_output_tokens": 2})
    assert r.json()["usage"]["input_tokens_details"] == {"cached_tokens": 32}


# ----- vLLM's HTTP request metrics (prometheus-fastapi-instrumentator) -----------------------


def test_http_request_metrics_have_vllms_names_and_labels(served):
    from prometheus_client.parser import text_string_to_metric_families

    _, client = served
    http = client()
    assert http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200
    assert http.post("/v1/completions", json={"prompt": "a", "bad": 1}).status_code == 400
    assert http.get("/v1/models").status_code == 200
    for probe in ("/health", "/ping", "/version"):
        http.get(probe)
    http.get("/metrics")
    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    requests = {(s.labels["handler"], s.labels["method"], s.labels["status"]): s.value
                for s in families["http_requests"].samples if s.name == "http_requests_total"}
    assert requests == {("/v1/completions", "POST", "2xx"): 1.0,
                        ("/v1/completions", "POST", "4xx"): 1.0,
                        ("/v1/models", "GET", "2xx"): 1.0}  # vLLM's excluded handlers absent
    for name, labels in [("http_request_size_bytes", {"handler"}),
                         ("http_response_size_bytes", {"handler"}),
                         ("http_request_duration_highr_seconds", set()),
                         ("http_request_duration_seconds", {"handler", "method"})]:
        samples = [s for s in families[name].samples if s.name.endswith(("_count", "_sum"))]
        assert samples, name
        assert all(labels <= s.labels.keys() for s in samples), (name, samples[:2])
    count = next(s.value for s in families["http_request_duration_seconds"].samples
                 if s.name.endswith("_count") and s.labels["handler"] == "/v1/models")
    assert count == 1.0
    assert any(n.startswith("vllm:") for n in families)  # the engine's metrics are still there
