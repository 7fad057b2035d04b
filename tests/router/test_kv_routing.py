"""kv-aware routing end to end on this machine: two real `shoal serve` groups publishing their
KV events (vLLM's --kv-events-config), a real `shoal router` routing `kv-aware` with the tiny
model's tokenizer. A prompt's repeats go where its prefix is cached (the engines' own prefix
cache counters confirm the hits); the router's /metrics show the index."""

from __future__ import annotations

import json

import httpx
import pytest
from router_helpers import API_KEY, MODEL_NAME, RouterProcess, ServeProcess, write_discovery
from support.net import free_port

pytestmark = pytest.mark.process

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
TENANT_A = "The billing team answers questions about invoices, refunds and payment plans. " * 12
TENANT_B = "Translate every sentence into French, keeping the names and the numbers. " * 12


@pytest.fixture(scope="module")
def kv_engines(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kv-engines")
    ports = {g: (free_port(), free_port()) for g in (0, 1)}
    started = {g: ServeProcess(tiny_model, tmp, "--max-model-len", "2048", "--kv-events-config",
                               json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                           "endpoint": f"tcp://*:{ev}",
                                           "replay_endpoint": f"tcp://*:{rp}"}),
                               api_key=API_KEY)
               for g, (ev, rp) in ports.items()}
    try:
        for e in started.values():
            e.wait_healthy()
        yield started, ports
    finally:
        for e in started.values():
            e.stop()


@pytest.fixture(scope="module")
def kv_router(tiny_model, kv_engines, tmp_path_factory):
    engines, ports = kv_engines
    tmp = tmp_path_factory.mktemp("kv-router")
    write_discovery(tmp / "engines.json", engines)
    flags = ["--kv-tokenizer", tiny_model]
    for g, (ev, rp) in ports.items():
        flags += ["--kv-endpoint", f"{g}=tcp://127.0.0.1:{ev},tcp://127.0.0.1:{rp}"]
    r = RouterProcess(tiny_model, tmp / "engines.json", tmp, *flags,
                      env={"SHOAL_ROUTER_ROUTING": "kv-aware"})
    try:
        yield r.wait_listening()
    finally:
        rc = r.stop()
    assert rc == 0, f"the router exited with {rc} after SIGTERM:\n{r.log()[-2000:]}"


def _complete(router: RouterProcess, prompt: str) -> None:
    r = httpx.post(f"{router.url}/v1/completions", headers=HEADERS, timeout=60,
                   json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1})
    assert r.status_code == 200, r.text


def _served(router: RouterProcess) -> dict[str, float]:
    return router.per_group()


def test_repeats_of_a_prefix_go_where_it_is_cached(kv_router, kv_engines):
    engines, _ = kv_engines
    homes = {}
    for name, tenant in (("a", TENANT_A), ("b", TENANT_B)):
        before, blocks = _served(kv_router), _blocks(kv_router)
        _complete(kv_router, tenant + "Question 0?")
        after = _served(kv_router)
        (home,) = [g for g in after if after[g] != before.get(g, 0)]
        homes[name] = home
        # Its blocks reach the router's index before the next request is routed.
        _wait_blocks(kv_router, home, more_than=blocks[home])
    hits_before = {g: engines[int(g)].metric("vllm:prefix_cache_hits_total")
                   for g in ("0", "1")}
    before = _served(kv_router)
    for i in range(1, 6):
        for tenant in (TENANT_A, TENANT_B):
            _complete(kv_router, tenant + f"Question {i}?")
    after = _served(kv_router)
    sent = {g: after.get(g, 0) - before.get(g, 0) for g in ("0", "1")}
    expected = {g: 5 * sum(1 for h in homes.values() if h == g) for g in ("0", "1")}
    assert sent == expected, (homes, sent, kv_router.log()[-3000:])
    for g in set(homes.values()):
        assert engines[int(g)].metric("vllm:prefix_cache_hits_total") > hits_before[g]
    m = kv_router.metrics()
    assert m["shoal_router_kv_index_groups"] == 2
    assert m["shoal_router_kv_index_blocks"] > 0
    assert m["shoal_router_kv_unrepaired_gaps"] == 0 and m["shoal_router_kv_stale_groups"] == 0


def _blocks(router: RouterProcess) -> dict[str, float]:
    return {g: router.metrics().get(f'shoal_router_kv_index_group_blocks{{group="{g}"}}', 0)
            for g in ("0", "1")}


def _wait_blocks(router: RouterProcess, group: str, more_than: float = 0,
                 timeout: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    key = f'shoal_router_kv_index_group_blocks{{group="{group}"}}'
    while router.metrics().get(key, 0) <= more_than:
        assert time.monotonic() < deadline, (f"no KV blocks of group {group} in the router's "
                                             f"index:\n{router.log()[-3000:]}")
        time.sleep(0.05)


def test_chats_with_a_shared_system_prompt_go_where_it_is_cached(kv_router):
    system = "You are the support assistant of a hardware shop; answer in one line. " * 12

    def chat(question: str) -> None:
        r = httpx.post(f"{kv_router.url}/v1/chat/completions", headers=HEADERS, timeout=60,
                       json={"model": MODEL_NAME, "max_tokens": 1, "messages": [
                           {"role": "system", "content": system},
                           {"role": "user", "content": question}]})
        assert r.status_code == 200, r.text

    before, blocks = _served(kv_router), _blocks(kv_router)
    chat("Do you sell screws?")
    after = _served(kv_router)
    (home,) = [g for g in after if after[g] != before.get(g, 0)]
    _wait_blocks(kv_router, home, more_than=blocks[home])
    for i in range(5):
        chat(f"Question number {i}?")
    final = _served(kv_router)
    sent = {g: final.get(g, 0) - after.get(g, 0) for g in ("0", "1")}
    assert sent[home] == 5, (home, sent)


async def test_the_prober_reads_each_engines_own_load(kv_engines):
    """A kv-aware router's health prober reads the engines' vLLM gauges (engine_load.py) from
    their real /metrics: an idle engine reports nothing running or waiting."""
    from shoal.router.discovery import Group
    from shoal.router.health import HealthProber
    from shoal.router.picker import GroupPicker

    engines, _ = kv_engines
    picker = GroupPicker(kv=object())  # only whether it routes kv-aware matters here
    picker.set_groups([Group(g, e.url) for g, e in engines.items()])
    async with httpx.AsyncClient() as client:
        await HealthProber(picker, client).probe_all()
    loads = {key[1]: state.engine for key, state in picker.states.items()}
    assert set(loads) == {0, 1}
    for g, load in loads.items():
        assert load is not None, g
        assert (load.running, load.waiting) == (0, 0) and 0 <= load.kv_usage <= 1


async def test_a_router_alone_sees_no_other_routers_load(kv_engines):
    """others(g) (engine_load.EngineLoad.others) from real engines' gauges, for a router alone
    in front of them: streams sent as its proxy sends them (acquired before, released when
    they end), the prober reading the gauges all the while. The engines report running
    requests, and never more than this router had in flight during the read: none is taken
    for another router's (the first form, max(outstanding, gauges), kept a finished one)."""
    import asyncio

    from shoal.router.discovery import Group
    from shoal.router.health import HealthProber
    from shoal.router.picker import GroupPicker

    engines, _ = kv_engines
    picker = GroupPicker(kv=object())
    groups = [Group(g, e.url) for g, e in engines.items()]
    picker.set_groups(groups)
    seen: list[tuple[float, float]] = []

    async def stream(client, group, i):
        body = {"model": MODEL_NAME, "prompt": f"stream {i}", "max_tokens": 200 + 50 * (i % 4),
                "stream": True, "ignore_eos": True}
        picker.acquire(group)
        try:
            async with client.stream("POST", f"{group.url}/v1/completions", json=body,
                                     headers=HEADERS) as r:
                assert r.status_code == 200
                async for _ in r.aiter_lines():
                    pass
        finally:
            picker.release(group)

    async def read(client, done):
        prober = HealthProber(picker, client)
        while not done.is_set():
            await asyncio.gather(*(prober.read_engine(g) for g in groups))
            seen.extend((s.engine.requests, s.engine.others) for s in picker.states.values()
                        if s.engine is not None)
            await asyncio.sleep(0.01)

    async with httpx.AsyncClient(timeout=60) as client:
        done = asyncio.Event()
        reader = asyncio.ensure_future(read(client, done))
        await asyncio.gather(*(stream(client, groups[i % 2], i) for i in range(12)))
        done.set()
        await reader
    assert max(r for r, _ in seen) >= 1, "no read saw a request running"
    assert max(o for _, o in seen) == 0, [x for x in seen if x[1]]
