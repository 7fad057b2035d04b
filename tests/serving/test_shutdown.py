"""SIGTERM semantics (`--shutdown-timeout`): 0 aborts what is in flight and tells the clients;
N > 0 drains: new requests get 503 while running ones finish. Both exit 0."""

from __future__ import annotations

import json
import signal

import httpx
import pytest
from support.servers import MODEL_NAME
from support.wait import wait_for

pytestmark = pytest.mark.process


def _stream(server, max_tokens: int):
    body = {"model": MODEL_NAME, "prompt": "import os", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    return httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120)


def _events(lines) -> list:
    return [line[6:] for line in lines if line.startswith("data: ")]


def test_sigterm_with_timeout_0_aborts_in_flight_requests_and_exits_0(serve_factory):
    server = serve_factory("--shutdown-timeout", "0").wait_healthy()
    with _stream(server, 1900) as r:
        lines = r.iter_lines()
        first = _events([next(line for line in lines if line.startswith("data: "))])
        server.proc.send_signal(signal.SIGTERM)
        events = first + _events(lines)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "abort"
    assert chunks[-1]["usage"]["completion_tokens"] < 1900
    assert server.wait_exit(60) == 0
    assert finishes.count("abort") == 1  # the one request in flight, aborted by the shutdown


def test_sigterm_with_a_timeout_drains_running_requests_and_refuses_new_ones(serve_factory):
    server = serve_factory("--shutdown-timeout", "120").wait_healthy()
    with _stream(server, 100) as r:
        lines = r.iter_lines()
        first = _events([next(line for line in lines if line.startswith("data: "))])
        server.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(f"{server.url}/health").status_code == 503, 10,
                 what="/health to report the drain")
        assert httpx.get(f"{server.url}/health").headers["retry-after"] == "1"
        refused = httpx.post(f"{server.url}/v1/completions",
                             json={"model": MODEL_NAME, "prompt": "a"}, timeout=10)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert "shutting down" in refused.json()["error"]["message"]
        events = first + _events(lines)
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 100
    assert server.wait_exit(60) == 0
