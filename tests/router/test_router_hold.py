"""Scale from zero at the frontend (hold.py): a real `shoal router` whose discovery says the
engine is `wakeable` with no group holds requests (and stays ready), sends them when a group
appears, and answers 503 / 429 with Retry-After past the wait or the queue; an engine that is
not wakeable still fails at once."""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest
from router_helpers import MODEL_NAME, GatewayProcess, RouterProcess
from shoal.contract import discovery as contract
from support.wait import wait_for

pytestmark = pytest.mark.process


def _write(path, groups: dict[int, str], wakeable: bool) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(contract.encode(MODEL_NAME, groups, wakeable=wakeable))
    os.replace(tmp, path)


def _post(router, stream: bool = False) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 3, "stream": stream}
    return httpx.post(f"{router.url}/v1/completions", headers=router.headers, json=body,
                      timeout=60)


@pytest.fixture
def at_zero(tiny_model, tmp_path):
    path = tmp_path / "engines.json"
    _write(path, {}, wakeable=True)

    def start(**env):
        r = RouterProcess(tiny_model, path, tmp_path, env=env)
        started.append(r)
        return r.wait_listening()

    started: list[RouterProcess] = []
    yield path, start
    for r in started:
        r.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_at_zero_waits_for_the_first_group_and_is_answered(at_zero, engines, stream):
    path, start = at_zero
    router = start()
    assert httpx.get(f"{router.url}/health", timeout=5).status_code == 200  # it can hold
    got: dict = {}

    def send():
        t0 = time.monotonic()
        got["resp"] = _post(router, stream)
        got["waited"] = time.monotonic() - t0

    sender = threading.Thread(target=send)
    sender.start()
    wait_for(lambda: router.metrics().get("shoal_router_holding_requests") == 1, 10,
             what="the request held", detail=lambda: router.log()[-1500:])
    time.sleep(1.0)  # held, not failed
    assert sender.is_alive()
    _write(path, {0: engines[0].url}, wakeable=True)  # the operator's first group is Ready
    sender.join(60)
    resp = got["resp"]
    assert resp.status_code == 200, resp.text
    assert ("data: [DONE]" in resp.text) if stream else resp.json()["choices"][0]["text"]
    assert got["waited"] >= 1.0
    m = router.metrics()
    assert m['shoal_router_held_requests_total{outcome="ready"}'] == 1
    assert m["shoal_router_holding_requests"] == 0
    assert "has no group: holding requests" in router.log()


def test_past_the_wait_503_and_past_the_queue_429_both_with_retry_after(at_zero):
    _, start = at_zero
    router = start(SHOAL_ROUTER_HOLD_SECONDS="2", SHOAL_ROUTER_HOLD_MAX="1")
    results: list[httpx.Response] = []
    first = threading.Thread(target=lambda: results.append(_post(router)))
    first.start()
    wait_for(lambda: router.metrics().get("shoal_router_holding_requests") == 1, 10,
             what="the first request held")
    full = _post(router)  # the queue holds one
    assert full.status_code == 429 and full.headers["Retry-After"] == "10", full.text
    assert "1 requests are already waiting" in full.json()["error"]["message"]
    first.join(30)
    (late,) = results
    assert late.status_code == 503 and late.headers["Retry-After"] == "10", late.text
    assert "scaled to zero and no group became ready within 2 s" in \
        late.json()["error"]["message"]
    m = router.metrics()
    assert m['shoal_router_held_requests_total{outcome="timeout"}'] == 1
    assert m['shoal_router_held_requests_total{outcome="full"}'] == 1


def test_an_engine_that_is_not_wakeable_fails_at_once(at_zero):
    path, start = at_zero
    _write(path, {}, wakeable=False)
    router = start()
    t0 = time.monotonic()
    resp = _post(router)
    assert resp.status_code == 503 and time.monotonic() - t0 < 5, resp.text
    assert "Retry-After" not in resp.headers
    assert httpx.get(f"{router.url}/health", timeout=5).status_code == 503


def test_the_gateway_lists_a_model_at_zero_and_holds_its_requests(engines, tmp_path):
    """The gateway: a wakeable engine with no group keeps its model in /v1/models (not a 404),
    a request for it waits, and is answered when the engine's first group appears."""
    d = tmp_path / "discovery"
    d.mkdir()
    _write(d / "team_chat.json", {}, wakeable=True)
    gw = GatewayProcess(tmp_path, "--discovery-dir", str(d)).wait_listening()
    try:
        models = httpx.get(f"{gw.url}/v1/models", headers=gw.headers, timeout=5).json()
        assert [m["id"] for m in models["data"]] == [MODEL_NAME]
        got: dict = {}
        sender = threading.Thread(target=lambda: got.update(resp=_post(gw)))
        sender.start()
        wait_for(lambda: gw.metrics().get("shoal_router_holding_requests") == 1, 10,
                 what="the gateway holding the request", detail=lambda: gw.log()[-1500:])
        _write(d / "team_chat.json", {0: engines[1].url}, wakeable=True)
        sender.join(60)
        assert got["resp"].status_code == 200, got["resp"].text
        assert gw.metrics()['shoal_router_held_requests_total{outcome="ready"}'] == 1
    finally:
        gw.stop()
