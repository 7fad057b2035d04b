"""The fleet frontend against two real engine groups: OpenAI traffic, spreading, discovery
changes, pass-through errors, auth, disconnects and group failures (the destructive test last)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import openai
import pytest
from router_helpers import (
    API_KEY,
    MODEL_NAME,
    RouterProcess,
    chat_with_system,
    engine_successes,
    kill_group,
    write_discovery,
)
from support.wait import wait_for

pytestmark = pytest.mark.process  # real processes and sockets (tests/conftest.py)


def _client(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key=API_KEY, max_retries=0,
                         timeout=60)


def _complete(router, n: int = 1) -> None:
    for _ in range(n):
        r = httpx.post(f"{router.url}/v1/completions", headers=router.headers, timeout=60,
                       json={"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2})
        assert r.status_code == 200, r.text


def _wait_listed(router, n: int) -> None:
    wait_for(lambda: router.metrics().get("shoal_router_groups_listed") == n, 10,
             what=f"the router to list {n} group(s)", detail=lambda: router.log()[-1500:])


def _wait_usable(router, n: int) -> None:
    wait_for(lambda: router.metrics().get("shoal_router_groups_usable") == n, 15,
             what=f"{n} usable group(s)", detail=lambda: router.log()[-1500:])


def test_openai_client_completions_and_chat(router):
    client = _client(router)
    c = client.completions.create(model=MODEL_NAME, prompt="Once upon", max_tokens=5,
                                  extra_body={"ignore_eos": True})
    assert c.model == MODEL_NAME and c.usage.completion_tokens == 5 and c.choices[0].text
    chunks = list(client.completions.create(model=MODEL_NAME, prompt="Once upon", max_tokens=5,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert len([ch for ch in chunks if ch.choices and ch.choices[0].text]) >= 2
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        extra_body={"ignore_eos": True})
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 4
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        stream=True, extra_body={"ignore_eos": True})
    parts = [ch.choices[0].delta.content for ch in stream if ch.choices]
    assert parts[0] == "" and len([p for p in parts if p]) >= 2
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    # A client that hangs up after `data: [DONE]` got everything: not a disconnect.
    wait_for(lambda: sum(router.per_group("ok").values()) == 4, 10, what="4 requests counted ok",
             detail=lambda: router.metrics())
    assert not router.per_group("disconnect")


def test_the_frontend_loads_no_model(router):
    import psutil

    mapped = [m.path for m in psutil.Process(router.proc.pid).memory_maps()]
    assert not [p for p in mapped if "libtorch" in p or "safetensors" in p]


def test_tokenize_and_detokenize_are_forwarded(router):
    tok = httpx.post(f"{router.url}/tokenize", json={"prompt": "hello world"}, timeout=30)
    assert tok.status_code == 200 and tok.json()["count"] == len(tok.json()["tokens"]) > 0
    back = httpx.post(f"{router.url}/detokenize", json={"tokens": tok.json()["tokens"]},
                      timeout=30)
    assert back.status_code == 200 and "hello world" in back.json()["prompt"]


def test_requests_spread_over_both_groups(router, engines):
    before = {g: engine_successes(e) for g, e in engines.items()}
    routed = router.per_group()
    _complete(router, 6)
    after = {g: engine_successes(e) for g, e in engines.items()}
    # Sequential requests tie on zero outstanding: round-robin alternates exactly.
    assert {g: after[g] - before[g] for g in engines} == {0: 3, 1: 3}
    now = router.per_group()
    assert {g: now.get(g, 0) - routed.get(g, 0) for g in ("0", "1")} == {"0": 3, "1": 3}


def test_removed_group_stops_and_added_group_starts_receiving(router, engines, discovery):
    write_discovery(discovery, {1: engines[1]})
    _wait_listed(router, 1)
    assert "group 0 removed" in router.log()
    before = {g: engine_successes(e) for g, e in engines.items()}
    _complete(router, 4)
    assert engine_successes(engines[0]) == before[0]
    assert engine_successes(engines[1]) == before[1] + 4

    write_discovery(discovery, engines)
    _wait_listed(router, 2)
    assert "group 0 added" in router.log()
    before = engine_successes(engines[0])
    _complete(router, 4)
    assert engine_successes(engines[0]) == before + 2


def test_bad_discovery_file_keeps_the_last_good_list(router, engines, discovery):
    discovery.write_text('{"groups": [{"group": 0, "url": ')
    wait_for(lambda: router.metrics().get("shoal_router_discovery_file_valid") == 0, 10,
             what="the router to notice the bad file")
    assert "is invalid: not valid JSON" in router.log()
    assert "keeping the last good list of 2 group(s)" in router.log()
    assert httpx.get(f"{router.url}/health", timeout=5).status_code == 200
    before = {g: engine_successes(e) for g, e in engines.items()}
    _complete(router, 2)
    assert all(engine_successes(e) == before[g] + 1 for g, e in engines.items())

    discovery.write_text(json.dumps({"groups": [{"group": "zero", "url": engines[0].url}]}))
    wait_for(lambda: "groups[0].group must be a non-negative integer" in router.log(), 10,
             what="the schema error to be logged")
    assert router.metrics()["shoal_router_groups_listed"] == 2
    write_discovery(discovery, engines)
    wait_for(lambda: router.metrics().get("shoal_router_discovery_file_valid") == 1, 10,
             what="the router to accept the file again")


class _DrainingGroup(BaseHTTPRequestHandler):
    """A group that is stopping: /health still 200 (the kubelet has not caught up), every
    request 503, as a draining `shoal serve` or `vllm serve` answers."""

    posts = 0

    def do_GET(self):  # noqa: N802 - http.server's naming
        self._answer(200, b"")

    def do_POST(self):  # noqa: N802
        type(self).posts += 1
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self._answer(503, json.dumps({"error": {"message": "the server is shutting down",
                                                "type": "ServiceUnavailableError",
                                                "param": None, "code": 503}}).encode())

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_group_answering_503_is_skipped_and_the_request_retried(router, engines, discovery):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _DrainingGroup)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    draining = type("Draining", (), {"url": f"http://127.0.0.1:{server.server_port}"})()
    try:
        write_discovery(discovery, {**engines, 7: draining})
        _wait_listed(router, 3)
        retries = router.metrics().get("shoal_router_retries_total", 0)
        before = sum(engine_successes(e) for e in engines.values())
        _complete(router, 6)
        assert sum(engine_successes(e) for e in engines.values()) == before + 6
        assert _DrainingGroup.posts >= 1
        assert router.metrics()["shoal_router_retries_total"] == retries + _DrainingGroup.posts
        assert router.metrics()[
            'shoal_router_upstream_errors_total{cause="unavailable",group="7"}'] >= 1
        assert "group 7 failed" in router.log() and "answered 503: the server is shutting down" \
            in router.log()
    finally:
        write_discovery(discovery, engines)
        _wait_listed(router, 2)
        server.shutdown()


def test_client_errors_pass_through_unchanged(router, engines):
    body = {"model": MODEL_NAME, "prompt": "word " * 2500, "max_tokens": 4}
    direct = httpx.post(f"{engines[0].url}/v1/completions", json=body,
                        headers=engines[0].headers, timeout=30)
    via = httpx.post(f"{router.url}/v1/completions", json=body, headers=router.headers,
                     timeout=30)
    assert direct.status_code == 400
    assert (via.status_code, via.json()) == (direct.status_code, direct.json())
    unknown = httpx.post(f"{router.url}/v1/completions", headers=router.headers, timeout=30,
                         json={"model": "nope", "prompt": "hi", "max_tokens": 1})
    assert unknown.status_code == 404 and "nope" in unknown.json()["error"]["message"]
    assert router.per_group("client_error")


def test_wrong_api_key_is_refused_at_the_router(router):
    routed = router.metrics()
    for headers in ({"Authorization": "Bearer wrong"}, {}):
        r = httpx.post(f"{router.url}/v1/completions", headers=headers, timeout=10,
                       json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1})
        assert r.status_code == 401
        err = r.json()["error"]
        assert err["type"] == "AuthenticationError" and "--api-key" in err["message"]
    assert httpx.get(f"{router.url}/v1/models", timeout=5).status_code == 401
    assert {k: v for k, v in router.metrics().items() if k.startswith("shoal_router_requests")} \
        == {k: v for k, v in routed.items() if k.startswith("shoal_router_requests")}


def test_client_disconnect_aborts_the_request_on_the_group(router, engines):
    def aborted() -> float:
        return sum(e.metric("vllm:request_success_total", 'finished_reason="abort"')
                   for e in engines.values())

    before, left = aborted(), sum(router.per_group("disconnect").values())
    with httpx.stream("POST", f"{router.url}/v1/completions", headers=router.headers,
                      timeout=30, json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1500,
                                        "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        next(r.iter_raw())
    wait_for(lambda: aborted() == before + 1, 20, what="the group to abort the abandoned stream")
    wait_for(lambda: sum(router.per_group("disconnect").values()) == left + 1, 10,
             what="the router to count the disconnect")
    # Not streamed: the router is reading the whole answer when the client gives up.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{router.url}/v1/completions", headers=router.headers, timeout=1.0,
                   json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1500,
                         "ignore_eos": True})
    wait_for(lambda: aborted() == before + 2, 20, what="the group to abort the abandoned request",
             detail=lambda: router.log()[-1500:])
    wait_for(lambda: sum(router.per_group("disconnect").values()) == left + 2, 10,
             what="the router to count the second disconnect")


def test_prefix_affinity_routing_of_the_per_engine_frontend(tiny_model, engines, discovery,
                                                            tmp_path):
    """SHOAL_ROUTER_ROUTING=prefix-affinity: chats that share a system prompt go to one group;
    a routing name it does not know is a configuration error."""
    r = RouterProcess(tiny_model, discovery, tmp_path,
                      env={"SHOAL_ROUTER_ROUTING": "prefix-affinity"})
    try:
        r.wait_listening()
        _wait_usable(r, 2)
        before = {g: engine_successes(e) for g, e in engines.items()}
        for i in range(6):
            chat_with_system(r.url, r.headers, MODEL_NAME, "You answer about parcels. " * 40,
                             f"Where is parcel {i}?")
        served = sorted(engine_successes(e) - before[g] for g, e in engines.items())
        assert served == [0, 6], served
        assert "(prefix-affinity)" in r.log()
    finally:
        assert r.stop() == 0
    bad = RouterProcess(tiny_model, discovery, tmp_path, env={"SHOAL_ROUTER_ROUTING": "random"})
    assert bad.proc.wait(30) == 2
    assert "SHOAL_ROUTER_ROUTING: routing 'random' is not one of least-outstanding, " \
        "prefix-affinity" in bad.log()
    bad.stop()


def test_group_failures(router, engines):
    """Last: kills both engines. One dead group: requests still succeed and /health stays 200;
    both dead: 503 saying no engine group is ready, and why."""
    _wait_usable(router, 2)
    # A group that dies mid-stream: the 200 is out, so the stream ends with a 502 error event.
    with httpx.stream("POST", f"{router.url}/v1/completions", headers=router.headers,
                      timeout=30, json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1500,
                                        "ignore_eos": True, "stream": True}) as r:
        chunks = r.iter_raw()
        first = next(chunks)
        outstanding = {g: router.metrics().get(
            f'shoal_router_outstanding_requests{{group="{g}"}}') for g in engines}
        victim = next(g for g, n in outstanding.items() if n == 1)
        kill_group(engines[victim])
        rest = (first + b"".join(chunks)).decode()
    assert f"engine group {victim} ({engines[victim].url}) failed mid-stream" in rest, rest[-500:]
    assert '"code": 502' in rest and rest.endswith("data: [DONE]\n\n")
    survivor = 1 - victim
    for _ in range(4):
        _complete(router)
    assert httpx.get(f"{router.url}/health", timeout=5).status_code == 200
    assert router.metrics().get(
        f'shoal_router_upstream_errors_total{{cause="midway",group="{victim}"}}', 0) >= 1

    kill_group(engines[survivor])
    r = httpx.post(f"{router.url}/v1/completions", headers=router.headers, timeout=30,
                   json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 503, r.text
    message = r.json()["error"]["message"]
    assert message.startswith("no engine group is ready") and engines[survivor].url in message
    health = httpx.get(f"{router.url}/health", timeout=5)
    assert health.status_code == 503
    detail = health.json()["error"]["message"]
    assert detail.startswith("no engine group is ready") and f"group {victim}" in detail
    assert pytest.approx(router.metrics()["shoal_router_groups_usable"]) == 0
