"""LoRA adapters through both routers, in front of real `shoal serve --enable-lora` groups with
adapters made by the real `peft`: an adapter request goes only to the groups whose own
/v1/models lists it (read by the routers' health prober), an adapter loaded at runtime on one
group becomes routable there, /v1/models lists every adapter under its parent, and a name no
group has is OpenAI's 404 naming what is served."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from router_helpers import (
    API_KEY,
    MODEL_NAME,
    GatewayProcess,
    RouterProcess,
    ServeProcess,
    engine_successes,
    local_discovery,
    write_atomically,
    write_discovery,
)
from shoal.contract import discovery
from shoal.operator import labels as L
from shoal.operator import render
from shoal.operator.spec import parse
from shoal.router.health import PROBE_INTERVAL_S as PROBE_INTERVAL
from support.wait import wait_for

from tests.engine import lora_peft

pytestmark = pytest.mark.process
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
LORA = ["--enable-lora", "--max-loras", "2", "--max-model-len", "1024"]
RUNTIME = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}


@pytest.fixture(scope="module")
def made(tiny_model, tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("router-lora")
    return {"a1": lora_peft.make_adapter(tiny_model, d / "a1", 31, r=4),
            "a2": lora_peft.make_adapter(tiny_model, d / "a2", 32, r=4)}


@pytest.fixture(scope="module")
def groups(tiny_model, made, tmp_path_factory):
    """Group 0 starts with adapter a1; group 1 has none (a2 is loaded there at runtime)."""
    tmp = tmp_path_factory.mktemp("lora-groups")
    started = {0: ServeProcess(tiny_model, tmp, *LORA, "--lora-modules", f"a1={made['a1']}",
                               env=RUNTIME, api_key=API_KEY),
               1: ServeProcess(tiny_model, tmp, *LORA, env=RUNTIME, api_key=API_KEY)}
    try:
        for e in started.values():
            e.wait_healthy()
        yield started
    finally:
        for e in started.values():
            e.stop()


@pytest.fixture(scope="module", params=["router", "gateway"])
def front(request, groups, tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    if request.param == "router":
        path = tmp / discovery.KEY
        write_discovery(path, groups)
        proc = RouterProcess(tiny_model, path, tmp)
        proc.set_groups = lambda engines: write_discovery(path, engines)
    else:
        d = tmp / "discovery"
        d.mkdir()
        body = {"apiVersion": L.API_VERSION, "kind": L.KIND,
                "metadata": {"name": "lora", "namespace": "prod", "uid": "u-lora"},
                "spec": {"model": "/models/tiny", "servedModelName": MODEL_NAME,
                         "replicas": 2}}

        def set_groups(engines):
            rendered = render.discovery_data(*parse(body), sorted(engines))
            write_atomically(d / "lora.json", local_discovery(rendered[discovery.KEY], engines))
        set_groups(groups)
        proc = GatewayProcess(tmp, "--discovery-dir", str(d))
        proc.set_groups = set_groups
    try:
        yield proc.wait_listening()
    finally:
        proc.stop()


def _cards(front) -> dict[str, dict]:
    r = httpx.get(f"{front.url}/v1/models", headers=HEADERS, timeout=10)
    return {c["id"]: c for c in r.json()["data"]} if r.status_code == 200 else {}


def _complete(front, model: str) -> httpx.Response:
    return httpx.post(f"{front.url}/v1/completions", headers=HEADERS, timeout=60,
                      json={"model": model, "prompt": "hello", "max_tokens": 2})


def _successes(groups) -> dict[int, float]:
    return {g: engine_successes(e) for g, e in groups.items()}


def test_an_adapter_goes_only_to_the_group_that_has_it(front, groups):
    wait_for(lambda: "a1" in _cards(front), 20, what="a1 listed by the router")
    cards = _cards(front)
    assert cards["a1"]["parent"] == MODEL_NAME and cards[MODEL_NAME]["parent"] is None
    before = _successes(groups)
    for _ in range(4):
        r = _complete(front, "a1")
        assert r.status_code == 200 and r.json()["model"] == "a1", r.text
    after = _successes(groups)
    assert {g: after[g] - before[g] for g in groups} == {0: 4, 1: 0}
    # The base model still goes to both groups.
    for _ in range(4):
        assert _complete(front, MODEL_NAME).status_code == 200
    assert all(engine_successes(e) > after[g] for g, e in groups.items())


def test_a_name_no_group_has_is_a_404_naming_the_served_models(front):
    wait_for(lambda: "a1" in _cards(front), 20, what="a1 listed by the router")
    r = _complete(front, "no-such-adapter")
    assert r.status_code == 404, r.text
    msg = r.json()["error"]["message"]
    assert "no-such-adapter" in msg and MODEL_NAME in msg and "a1" in msg, msg


def test_an_adapter_loaded_at_runtime_is_routed_to_where_it_was_loaded(front, groups, made):
    if "a2" not in _cards(groups[1]):
        r = httpx.post(f"{groups[1].url}/v1/load_lora_adapter", headers=HEADERS, timeout=60,
                       json={"lora_name": "a2", "lora_path": made["a2"]})
        assert r.status_code == 200, r.text
    wait_for(lambda: "a2" in _cards(front), 20, what="a2 listed by the router")
    before = _successes(groups)
    for _ in range(3):
        assert _complete(front, "a2").status_code == 200
    after = _successes(groups)
    assert {g: after[g] - before[g] for g in groups} == {0: 0, 1: 3}


def test_a_group_that_unloaded_an_adapter_since_its_list_was_read_is_skipped(front, groups,
                                                                            made):
    """The groups unload the adapter behind the routers' back (their lists are up to a probe
    round old): each 404 drops it from that group's state and the request goes to a group that
    still has it; with none left the 404 is the router's, naming it."""
    name = f"gone-{front.port}"
    for e in groups.values():
        r = httpx.post(f"{e.url}/v1/load_lora_adapter", headers=HEADERS, timeout=60,
                       json={"lora_name": name, "lora_path": made["a1"]})
        assert r.status_code == 200, r.text
    wait_for(lambda: name in _cards(front), 20, what=f"{name} listed by the router")
    time.sleep(2 * PROBE_INTERVAL)  # both groups' lists read with it
    misses = _misses(front)
    unload = {"lora_name": name}
    assert httpx.post(f"{groups[0].url}/v1/unload_lora_adapter", headers=HEADERS,
                      json=unload, timeout=30).status_code == 200
    for _ in range(4):
        r = _complete(front, name)
        assert r.status_code == 200, r.text
    assert httpx.post(f"{groups[1].url}/v1/unload_lora_adapter", headers=HEADERS,
                      json=unload, timeout=30).status_code == 200
    r = _complete(front, name)
    assert r.status_code == 404 and f"`{name}` does not exist" in r.text
    # the router's answer (naming the groups, or, when a probe round read both lists since the
    # unload, what is available), never a group's ("Served models")
    assert "no group has it loaded now" in r.text or "Available models: a1, a2" in r.text
    if "no group has it loaded now" in r.text:  # the groups' own 404s decided it: counted
        assert _misses(front) - misses >= 1
    # (a probe round that read both lists after the unloads answers without asking a group:
    # no 404 to count; seen once with the suite's tiers side by side, 2026-12-07)


def _misses(front) -> float:
    return front.metrics().get("shoal_router_adapter_misses_total", 0.0)


def test_a_group_that_just_came_is_read_before_the_routers_own_404(front, groups, made):
    """The only group listing an adapter leaves discovery and another group that has it loaded
    comes (a restarted group returns under a new address, held out of discovery by the operator
    until its adapters are loaded): the router reads what the new group lists before it would
    answer the name with its own 404, so no request of the switch gets one (found by
    benchmarks/lora_churn.py: 404s while the adapter was Ready)."""
    name = f"moving-{front.port}"
    for e in groups.values():
        r = httpx.post(f"{e.url}/v1/load_lora_adapter", headers=HEADERS, timeout=60,
                       json={"lora_name": name, "lora_path": made["a1"]})
        assert r.status_code == 200, r.text
    codes: list[int] = []
    stop = threading.Event()

    def send():
        while not stop.is_set():
            codes.append(_complete(front, name).status_code)
    try:
        front.set_groups({0: groups[0]})
        wait_for(lambda: front.metrics().get("shoal_router_groups_listed") == 1, 20,
                 what="only group 0 listed")
        wait_for(lambda: _complete(front, name).status_code == 200, 20,
                 what=f"{name} served by group 0")
        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        wait_for(lambda: len(codes) >= 3, 30, what="requests flowing")
        front.set_groups({1: groups[1]})
        served = _successes(groups)[1]
        wait_for(lambda: _successes(groups)[1] > served + 3, 30, what="group 1 serving it")
        stop.set()
        sender.join(60)
    finally:
        stop.set()
        front.set_groups(groups)
        for e in groups.values():
            httpx.post(f"{e.url}/v1/unload_lora_adapter", headers=HEADERS, timeout=30,
                       json={"lora_name": name})
    assert codes and set(codes) == {200}, f"{codes.count(404)} of {len(codes)} answered 404"
