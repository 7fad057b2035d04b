"""The HTTP surface's own contract, in process (no engine): GET /openapi.json documents exactly
the error statuses each route answers (each is made to happen here), every 503 that means "come
back later" carries Retry-After, and /health declares its content type.

The app is the real `build_app`; the engine behind it is a stand-in whose availability logic is
AsyncLLM's own (`_check_available`, `is_healthy`), with a real tokenizer and input processor."""

from __future__ import annotations

import types

import pytest
from fastapi.testclient import TestClient
from shoal.engine.entrypoints.api_server import build_app
from shoal.engine.entrypoints.http_errors import ErrorResponse, exception_response
from shoal.engine.errors import RETRY_AFTER_S, EngineDeadError, RequestRejectedError
from shoal.engine.frontend.async_llm import AsyncLLM
from shoal.engine.frontend.input_processor import InputProcessor
from shoal.engine.frontend.metrics import FrontendMetrics
from shoal.engine.tokenizer import load_tokenizer
from shoal.engine.wire import EngineDead

KEY = "k"
AUTH = {"Authorization": f"Bearer {KEY}"}
DEAD = EngineDeadError(EngineDead("EngineCore_0", 1, 0, "RuntimeError", "boom"))


class EngineStandIn:
    """What the HTTP layer reads of AsyncLLM before a request reaches the engine."""

    _check_available = AsyncLLM._check_available
    is_healthy = AsyncLLM.is_healthy

    def __init__(self, model: str) -> None:
        self.tokenizer = load_tokenizer(model)
        self.config = types.SimpleNamespace(model=model)
        self.max_model_len = 64
        self.input_processor = InputProcessor(self.tokenizer, max_model_len=64,
                                              vocab_size=len(self.tokenizer))
        self.metrics = FrontendMetrics("tiny")
        self.draining = self.stopped = False
        self.dead_error = None


@pytest.fixture(scope="module")
def app(tiny_model):
    llm = EngineStandIn(tiny_model)
    return llm, TestClient(build_app(llm, served_model_names=["tiny"], api_keys=[KEY]))


CHAT = {"messages": [{"role": "user", "content": "hi"}]}
# route -> {status: (request body or None for GET, headers, engine state)}; each documented
# status of each route must be here, and each entry must really be answered.
TRIGGERS = {
    ("post", "/v1/completions"): {
        400: ({"prompt": "a", "logit_bias": {"5": 1}}, AUTH, None),
        401: ({"prompt": "a"}, {}, None),
        404: ({"prompt": "a", "model": "gpt-9"}, AUTH, None),
        500: ({"prompt": "a"}, AUTH, "dead"),
        503: ({"prompt": "a"}, AUTH, "draining"),
    },
    ("post", "/v1/chat/completions"): {
        400: ({"messages": []}, AUTH, None),
        401: (CHAT, {}, None),
        404: ({**CHAT, "model": "gpt-9"}, AUTH, None),
        500: (CHAT, AUTH, "dead"),
        503: (CHAT, AUTH, "draining"),
    },
    ("post", "/v1/responses"): {
        400: ({}, AUTH, None),
        401: ({"input": "a"}, {}, None),
        404: ({"input": "a", "model": "gpt-9"}, AUTH, None),
        500: ({"input": "a"}, AUTH, "dead"),
        503: ({"input": "a"}, AUTH, "draining"),
    },
    ("get", "/v1/models"): {401: (None, {}, None)},
    ("get", "/health"): {503: (None, {}, "draining")},
    ("get", "/ping"): {503: (None, {}, "draining")},
    ("post", "/ping"): {503: (None, {}, "dead")},
    ("post", "/invocations"): {  # not under /v1: no key, as in vLLM
        400: ({"input": "a"}, {}, None),
        404: ({**CHAT, "model": "gpt-9"}, {}, None),
        500: ({"prompt": "a"}, {}, "dead"),
        503: (CHAT, {}, "draining"),
    },
    ("post", "/tokenize"): {400: ({}, {}, None), 404: ({"prompt": "a", "model": "x"}, {}, None)},
    ("post", "/detokenize"): {400: ({"tokens": [10**9]}, {}, None),
                              404: ({"tokens": [1], "model": "x"}, {}, None)},
    ("get", "/version"): {},
    ("get", "/metrics"): {},
}


def _set_state(llm: EngineStandIn, state: str | None) -> None:
    llm.draining = state == "draining"
    llm.dead_error = DEAD if state == "dead" else None


def test_openapi_documents_exactly_the_errors_each_route_answers(app):
    llm, client = app
    schema = client.get("/openapi.json").json()
    documented = {(method, path): {int(c) for c in op["responses"] if c != "200"}
                  for path, ops in schema["paths"].items() for method, op in ops.items()}
    assert documented == {route: set(codes) for route, codes in TRIGGERS.items()}
    error_schema = schema["components"]["schemas"]["ErrorResponse"]
    assert error_schema["properties"]["error"]
    try:
        for (method, path), codes in TRIGGERS.items():
            for status, (body, headers, state) in codes.items():
                _set_state(llm, state)
                r = client.request(method.upper(), path, json=body, headers=headers)
                assert r.status_code == status, (method, path, r.text)
                ErrorResponse.model_validate(r.json())  # the documented shape
                ref = schema["paths"][path][method]["responses"][str(status)]
                assert ref["content"]["application/json"]["schema"]["$ref"].endswith(
                    "/ErrorResponse")
    finally:
        _set_state(llm, None)


def test_every_come_back_later_503_carries_retry_after(app):
    llm, client = app
    try:
        _set_state(llm, "draining")
        for r in (client.get("/health"),
                  client.post("/v1/completions", json={"prompt": "a"}, headers=AUTH),
                  client.post("/v1/chat/completions", json=CHAT, headers=AUTH)):
            assert r.status_code == 503 and r.headers["retry-after"] == str(RETRY_AFTER_S)
        _set_state(llm, "dead")  # not "later": the engine is gone, the server exits
        r = client.post("/v1/completions", json={"prompt": "a"}, headers=AUTH)
        assert r.status_code == 500 and "retry-after" not in r.headers
    finally:
        _set_state(llm, None)
    # The engine's own refusal while it drains (a race with the frontend's flag) says the same.
    rejected = exception_response(RequestRejectedError("draining", 503))
    assert rejected.status_code == 503 and rejected.headers["retry-after"] == "1"
    invalid = exception_response(RequestRejectedError("bad", 400))
    assert "retry-after" not in invalid.headers


def test_health_is_an_empty_text_plain_200_and_a_json_503(app):
    llm, client = app
    ok = client.get("/health")
    assert ok.status_code == 200 and ok.text == ""
    assert ok.headers["content-type"].startswith("text/plain")
    try:
        _set_state(llm, "dead")
        down = client.get("/health")
    finally:
        _set_state(llm, None)
    assert down.status_code == 503 and down.headers["content-type"] == "application/json"
    assert "boom" in down.json()["error"]["message"]
