"""A request field the server does not implement is a 400 that names it, never silently ignored;
fields that mean nothing at their default value (`user`, `store: false`, `logit_bias: {}`, ...)
are accepted and change nothing.

Rejections are checked in process (the real app over an engine stand-in: validation happens
before any engine is involved); acceptance against a real `shoal serve` with the openai client.
"""

from __future__ import annotations

import openai
import pytest
from fastapi.testclient import TestClient
from shoal.engine.entrypoints.api_server import build_app
from support.servers import MODEL_NAME, ServeProcess
from test_openapi_health import EngineStandIn

pytestmark = pytest.mark.process

CHAT = [{"role": "user", "content": "hi"}]
NO_OPS = {"user": "someone", "logit_bias": {}, "store": False, "metadata": {"team": "a"},
          "service_tier": "auto", "parallel_tool_calls": True}


@pytest.fixture(scope="module")
def http(tiny_model):
    return TestClient(build_app(EngineStandIn(tiny_model), served_model_names=[MODEL_NAME]))


REJECTED = [
    # (path, body, fields the message must name, param)
    ("/v1/completions", {"prompt": "a", "frobnicate": 1}, ["frobnicate"], "frobnicate"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"50": 10}}, ["logit_bias"], "logit_bias"),
    ("/v1/chat/completions", {"messages": CHAT, "store": True}, ["store"], "store"),
    ("/v1/chat/completions", {"messages": CHAT, "service_tier": "flex"}, ["service_tier"],
     "service_tier"),
    ("/v1/chat/completions", {"messages": CHAT, "web_search_options": {}},
     ["web_search_options"], "web_search_options"),
    ("/v1/chat/completions", {"messages": [{**CHAT[0], "refusal": "no"}]},
     ["messages.0.refusal"], "messages.0.refusal"),
    ("/v1/completions", {"prompt": "a", "stream": True,
                         "stream_options": {"include_usage": True, "include_obfuscation": True}},
     ["stream_options.include_obfuscation"], "stream_options.include_obfuscation"),
    ("/v1/chat/completions", {"messages": CHAT, "prediction": {"type": "content"}, "audio": {},
                              "logit_bias": {"1": -100}}, ["prediction", "audio", "logit_bias"],
     None),
    ("/tokenize", {"prompt": "a", "truncate": 3}, ["truncate"], "truncate"),
    ("/detokenize", {"tokens": [1], "skip": True}, ["skip"], "skip"),
]


@pytest.mark.parametrize("case", REJECTED, ids=[",".join(c[2]) for c in REJECTED])
def test_an_unimplemented_field_is_a_400_naming_it(http, case):
    path, body, names, param = case
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"].startswith("unsupported field(s): ")
    for name in names:
        assert name in err["message"]
    if param is not None:
        assert err["param"] == param
    else:
        assert err["param"] in names


def test_a_wrong_type_is_still_named_as_a_wrong_type(http):
    r = http.post("/v1/completions", json={"prompt": "a", "temperature": "hot"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "temperature"
    assert "unsupported" not in err["message"] and "temperature" in err["message"]


@pytest.fixture(scope="module")
def client(tiny_model, tmp_path_factory):
    s = ServeProcess(tiny_model, tmp_path_factory.mktemp("fields"))
    try:
        s.wait_healthy()
        yield openai.OpenAI(base_url=f"{s.url}/v1", api_key="none", max_retries=0)
    finally:
        s.stop()


def test_default_valued_no_op_fields_are_accepted_and_change_nothing(client):
    def chat(**extra):
        return client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=6,
                                              temperature=0, **extra).choices[0].message.content

    def complete(**extra):
        return client.completions.create(model=MODEL_NAME, prompt="def f(", max_tokens=6,
                                         temperature=0, **extra).choices[0].text

    assert chat(**NO_OPS) == chat()
    assert complete(user="someone", logit_bias={}) == complete()
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        complete(logit_bias={"50": 10})
