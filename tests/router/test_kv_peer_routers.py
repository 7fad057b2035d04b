"""The real peer routers from the package index in front of real `shoal serve` groups: does
`vllm-router --policy kv_aware` route Shoal engines by the KV events they publish (vLLM's
--kv-events-config), and does sglang-router's cache_aware serve them?

Two groups publish their events (ZMQ PUB and replay ROUTER on loopback); vllm-router 0.1.17
subscribes to both (support/peer_routers.py has its command line). The discriminating setup:
each tenant's long prefix is cached on a group *directly* (not through the router), the other
way round from where a router that ignores the events would send a miss (the least-loaded
worker, the first on a tie), so its repeats reach the right group only if vllm-router consumed
that group's events. The engines' own counters (`vllm:request_success`,
`vllm:prefix_cache_hits`) are the evidence; vllm-router's log (`kv_index live/replay sequence
advanced`) and metrics (`vllm_router_kv_placement_lookups_total`) show its side.

vllm-router tokenizes through the workers: `/v1/completions/render` (Shoal: 404, as a
`vllm serve` without VLLM_ENABLE_SCALE_OUT_ENDPOINTS), then `/tokenize`. For a chat it sends
`/tokenize` `{"messages": ..., "continue_final_message": false}`, which Shoal's /tokenize takes
(true is refused, naming it): chats are routed by their cached system prompt too.
"""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest
from router_helpers import API_KEY, MODEL_NAME, ServeProcess, engine_successes, prefix_cache
from support.net import free_ports
from support.peer_routers import KvSource, sglang_router, vllm_router
from support.wait import wait_for

pytestmark = pytest.mark.process

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
TENANT_A = "The billing team answers questions about invoices, refunds and payment plans. " * 12
TENANT_B = "Translate every sentence into French, keeping the names and the numbers. " * 12
TENANT_C = "Summarise each support ticket in two lines and name the product concerned. " * 12


@pytest.fixture(scope="module")
def kv_engines(tiny_model, tmp_path_factory):
    """Two groups, each publishing KV events and serving replay on its own loopback ports."""
    tmp = tmp_path_factory.mktemp("peer-kv-engines")
    ports = free_ports(4)
    started = {}
    try:
        for g in (0, 1):
            ev, rp = ports[2 * g], ports[2 * g + 1]
            e = ServeProcess(tiny_model, tmp, "--max-model-len", "2048", "--kv-events-config",
                             json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                         "endpoint": f"tcp://*:{ev}",
                                         "replay_endpoint": f"tcp://*:{rp}"}), api_key=API_KEY)
            e.kv = KvSource(f"tcp://127.0.0.1:{ev}", f"tcp://127.0.0.1:{rp}")
            started[g] = e
        for e in started.values():
            e.wait_healthy()
        yield started
    finally:
        for e in started.values():
            e.stop()


def _start_vllm_kv_router(engines, tmp):
    urls = [engines[g].url for g in (0, 1)]
    r = vllm_router(tmp, urls, "kv_aware", kv={e.url: e.kv for e in engines.values()},
                    model=MODEL_NAME, log_level="debug", extra=("--api-key", API_KEY))
    return r.start().wait_serving()


def _publish_until_applied(router, engine, kind: str = "live", timeout: float = 20) -> None:
    """Send `engine` new prompts (each publishes a batch) until vllm-router logs one of its
    batches as applied (`kind`: live, or replay after a gap): its SUB socket joins a moment
    after it serves, and ZeroMQ drops what a subscriber not yet joined would have got."""
    seen = _consumed(router, engine, kind)
    deadline = time.monotonic() + timeout
    n = 0
    while _consumed(router, engine, kind) <= seen:
        assert time.monotonic() < deadline, (f"vllm-router applied no {kind} KV batch of "
                                             f"{engine.url}:\n{router.log()[-3000:]}")
        n += 1
        _complete(engine.url, f"Warm-up {n} {time.monotonic()}: " + "a garden of tomatoes " * 8)
        time.sleep(0.3)


@pytest.fixture(scope="module")
def kv_router(kv_engines, tmp_path_factory):
    r = _start_vllm_kv_router(kv_engines, tmp_path_factory.mktemp("vllm-router"))
    try:
        for e in kv_engines.values():
            _publish_until_applied(r, e)
        yield r
    finally:
        r.stop()


def _complete(url: str, prompt: str, max_tokens: int = 1, stream: bool = False) -> str:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    if not stream:
        r = httpx.post(f"{url}/v1/completions", headers=HEADERS, json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    text = ""
    with httpx.stream("POST", f"{url}/v1/completions", headers=HEADERS, json=body,
                      timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def _consumed(router, engine, kind: str = "live") -> int:
    """The highest sequence number of `engine`'s batches vllm-router logged as applied."""
    seqs = re.findall(rf"kv_index {kind} sequence advanced source={re.escape(engine.url)} "
                      r"rank=0 seq=(\d+)", router.log())
    return max(map(int, seqs), default=-1)


def _wait_consumed(router, engine, past: int, kind: str = "live") -> None:
    wait_for(lambda: _consumed(router, engine, kind) > past, 10, interval=0.05,
             what=f"vllm-router to apply a {kind} KV batch of {engine.url} after seq {past}",
             detail=lambda: router.log()[-3000:])


def _successes(engines) -> dict[int, float]:
    return {g: engine_successes(e) for g, e in engines.items()}


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def test_serves_openai_completions_through_to_shoal_engines(kv_router, kv_engines):
    before = _successes(kv_engines)
    assert _complete(kv_router.url, "The quick brown fox", max_tokens=4)
    assert _complete(kv_router.url, "The quick brown fox", max_tokens=4, stream=True)
    r = httpx.get(f"{kv_router.url}/v1/models", headers=HEADERS, timeout=10)
    assert r.status_code == 200 and MODEL_NAME in r.text, r.text
    assert sum(_delta(_successes(kv_engines), before).values()) == 2


def test_repeats_of_a_prefix_go_to_the_group_whose_events_say_it_is_cached(kv_router,
                                                                           kv_engines):
    homes = {1: TENANT_A, 0: TENANT_B}  # group -> the tenant cached there, bypassing the router
    for g, tenant in homes.items():
        seen = _consumed(kv_router, kv_engines[g])
        _complete(kv_engines[g].url, tenant + "Question 0?")
        _wait_consumed(kv_router, kv_engines[g], past=seen)
    lookups = kv_router.metrics()
    before = _successes(kv_engines)
    hits = {g: prefix_cache(e)[0] for g, e in kv_engines.items()}
    for i in range(1, 6):
        for tenant in homes.values():
            _complete(kv_router.url, tenant + f"Question {i}?")
    sent = _delta(_successes(kv_engines), before)
    assert sent == {0: 5, 1: 5}, (sent, kv_router.log()[-3000:])
    for g, e in kv_engines.items():  # each repeat reused the prefix: ~200 of its ~220 tokens
        assert prefix_cache(e)[0] - hits[g] >= 5 * 192, (g, prefix_cache(e), hits[g])
    after = kv_router.metrics()
    key = 'vllm_router_kv_placement_lookups_total{result="hit"}'
    assert after.get(key, 0) - lookups.get(key, 0) == 10, after
    credited = [int(c) for c in re.findall(r"credited_prefix_tokens=(\d+)", kv_router.log())]
    assert sum(1 for c in credited[-10:] if c >= 192) == 10, credited[-10:]


def test_a_router_started_late_replays_the_batches_it_missed(kv_engines, tmp_path):
    """Shoal's replay socket serves the peer's consumer: a new vllm-router sees a group's next
    batch after seq 0, asks the replay endpoint for the rest, and knows that group's cache."""
    _complete(kv_engines[1].url, TENANT_C + "Question 0?")  # cached before the router exists
    router = _start_vllm_kv_router(kv_engines, tmp_path)
    try:
        # Other prompts on group 1 publish batches the router sees live, after a gap.
        _publish_until_applied(router, kv_engines[1], kind="replay")
        before = _successes(kv_engines)
        for i in range(1, 4):
            _complete(router.url, TENANT_C + f"Question {i}?")
        assert _delta(_successes(kv_engines), before) == {0: 0, 1: 3}, router.log()[-3000:]
    finally:
        router.stop()


def test_chat_repeats_go_to_the_group_whose_events_say_their_system_prompt_is_cached(
        kv_router, kv_engines):
    """vllm-router 0.1.17 tokenizes a chat with Shoal's `/tokenize` {"model",
    "continue_final_message": false, "messages"} (the chat template applied by the engine), so
    a chat whose system prompt was cached on group 1 directly goes there through the router,
    where a router that ignored the events would send it to group 0 (least loaded, first)."""
    system = "You are the support assistant of a hardware shop; answer in one line. " * 12

    def chat(url: str, question: str) -> None:
        r = httpx.post(f"{url}/v1/chat/completions", headers=HEADERS, timeout=60,
                       json={"model": MODEL_NAME, "max_tokens": 1, "messages": [
                           {"role": "system", "content": system},
                           {"role": "user", "content": question}]})
        assert r.status_code == 200, r.text

    body = {"model": MODEL_NAME, "continue_final_message": True,
            "messages": [{"role": "user", "content": "hello"}]}
    r = httpx.post(f"{kv_engines[0].url}/tokenize", headers=HEADERS, json=body, timeout=10)
    assert r.status_code == 400 and "continue_final_message" in r.text, r.text
    seen = _consumed(kv_router, kv_engines[1])
    chat(kv_engines[1].url, "Do you sell hammers?")
    _wait_consumed(kv_router, kv_engines[1], past=seen)
    before, lookups = _successes(kv_engines), kv_router.metrics()
    for q in ("Do you sell screws?", "Are you open on Sunday?", "Do you deliver?"):
        chat(kv_router.url, q)
    assert _delta(_successes(kv_engines), before) == {0: 0, 1: 3}, kv_router.log()[-3000:]
    after = kv_router.metrics()
    key = 'vllm_router_kv_placement_lookups_total{result="hit"}'
    assert after.get(key, 0) - lookups.get(key, 0) == 3, after


def test_sglang_router_cache_aware_keeps_a_prefix_on_one_group(kv_engines, tmp_path):
    """sglang-router's approximate tree (no events) serves Shoal engines: completions and chats
    go through, and repeats of a long prefix stay on the group that served the first."""
    router = sglang_router(tmp_path, [kv_engines[g].url for g in (0, 1)], "cache_aware",
                           extra=("--api-key", API_KEY)).start().wait_serving()
    try:
        before = _successes(kv_engines)
        tenant = "Answer in the voice of a ship's captain, briefly and politely. " * 12
        for i in range(4):
            _complete(router.url, tenant + f"Question {i}?")
        r = httpx.post(f"{router.url}/v1/chat/completions", headers=HEADERS, timeout=60,
                       json={"model": MODEL_NAME, "max_tokens": 2,
                             "messages": [{"role": "user", "content": "Hello there"}]})
        assert r.status_code == 200, r.text
        sent = _delta(_successes(kv_engines), before)
        assert sum(sent.values()) == 5 and max(sent.values()) >= 4, (sent, router.log()[-2000:])
    finally:
        router.stop()


def test_vllm_router_cache_aware_keeps_a_prefix_on_one_group(kv_engines, tmp_path):
    router = vllm_router(tmp_path, [kv_engines[g].url for g in (0, 1)], "cache_aware",
                         extra=("--api-key", API_KEY)).start().wait_serving()
    try:
        before = _successes(kv_engines)
        tenant = "Reply as a librarian who recommends exactly one book each time. " * 12
        for i in range(4):
            _complete(router.url, tenant + f"Question {i}?")
        sent = _delta(_successes(kv_engines), before)
        assert sum(sent.values()) == 4 and max(sent.values()) == 4, (sent, router.log()[-2000:])
    finally:
        router.stop()
