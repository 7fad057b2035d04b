"""`spec.frontend.routing: kv-aware` on real pods: two groups whose rank 0 publishes its KV
events, a frontend that reads the model's tokenizer from the model's volume and subscribes to
both. A shared prefix goes where it is cached (the engine's own prefix-cache counter confirms the
hits); a killed group leaves the frontend's index and nothing is routed to it."""

from __future__ import annotations

import re
import time
import urllib.request

import pytest
from support.wait import wait_for

from e2e.e2e_helpers import (
    MODEL,
    client,
    create,
    frontend_metrics,
    group_metric,
    kill9_engine_core,
    pods,
    record,
    service_url,
    wait_ready,
    wait_serving,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
NAME = "kv"
TENANT = "The billing team answers questions about invoices, refunds and payment plans. " * 10
GROUPS = (0, 1)


@pytest.fixture(scope="module")
def routed(cluster):
    ns = cluster.new_namespace("e2e-kv")
    t0 = time.monotonic()
    create(cluster, ns, NAME, replicas=2, backoff_base=2,
           frontend={"replicas": 1, "routing": "kv-aware",
                     "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}}})
    wait_ready(cluster, ns, NAME, "2/2")
    url = service_url(cluster, ns, NAME)
    wait_serving(url)
    # Both groups' events followed (subscribed when discovery listed them).
    wait_for(lambda: frontend_metrics(cluster, ns, NAME).get("shoal_router_kv_index_groups") == 2,
             timeout=60, interval=0.5, what="the frontend following both groups' KV events")
    record("kv_apply_to_serving", time.monotonic() - t0)
    yield {"ns": ns, "url": url}
    cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def _served(cluster, ns) -> dict[int, float]:
    m = frontend_metrics(cluster, ns, NAME)
    return {g: group_metric(m, "shoal_router_requests_total", g) for g in GROUPS}


def _blocks(cluster, ns) -> dict[int, float]:
    m = frontend_metrics(cluster, ns, NAME)
    return {g: m.get(f'shoal_router_kv_index_group_blocks{{group="{g}"}}', 0.0) for g in GROUPS}


def _engine_hits(cluster, ns, group: int) -> float:
    (pod,) = pods(cluster, ns, f"shoal.dev/engine={NAME},shoal.dev/group={group},"
                               "shoal.dev/rank=0")
    with urllib.request.urlopen(f"http://{pod['status']['podIP']}:8000/metrics",
                                timeout=10) as r:
        text = r.read().decode()
    return sum(float(v) for v in re.findall(r"^vllm:prefix_cache_hits_total(?:\{[^}]*\})? "
                                            r"([0-9.e+-]+)$", text, re.M))


def _complete(url: str, prompt: str) -> None:
    out = client(url, timeout=60).completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert out.choices


def test_a_shared_prefix_goes_where_it_is_cached(cluster, routed):
    ns, url = routed["ns"], routed["url"]
    before, blocks = _served(cluster, ns), _blocks(cluster, ns)
    _complete(url, TENANT + "Question 0?")
    after = _served(cluster, ns)
    (home,) = [g for g in GROUPS if after[g] != before[g]]
    # Its blocks reach the frontend's index (events from rank 0's pod) before the repeats.
    wait_for(lambda: _blocks(cluster, ns)[home] > blocks[home], timeout=15, interval=0.2,
             what=f"group {home}'s KV blocks in the frontend's index")
    hits = _engine_hits(cluster, ns, home)
    before = _served(cluster, ns)
    for i in range(1, 7):
        _complete(url, TENANT + f"Question {i}?")
    after = _served(cluster, ns)
    sent = {g: after[g] - before[g] for g in GROUPS}
    assert sent == {g: 6 if g == home else 0 for g in GROUPS}, (home, sent)
    assert _engine_hits(cluster, ns, home) > hits  # the engine reused the prefix
    m = frontend_metrics(cluster, ns, NAME)
    assert m["shoal_router_kv_unrepaired_gaps"] == 0 and m["shoal_router_kv_stale_groups"] == 0
    routed["home"] = home


def test_a_killed_group_leaves_the_index_and_gets_nothing(cluster, routed):
    ns, url = routed["ns"], routed["url"]
    home = routed.get("home", 0)
    other = 1 - home
    assert _blocks(cluster, ns)[home] > 0
    pod = f"{NAME}-g{home}-r0"
    kill9_engine_core(cluster, ns, pod)
    t_kill = time.monotonic()

    def left() -> bool:
        m = frontend_metrics(cluster, ns, NAME)
        return (m.get("shoal_router_kv_index_groups") == 1
                and m.get(f'shoal_router_kv_index_group_blocks{{group="{home}"}}', 0.0) == 0)

    wait_for(left, timeout=60, interval=0.5, what=f"group {home} gone from the index")
    record("kv_kill_to_index_dropped", time.monotonic() - t_kill)
    before = _served(cluster, ns)
    for i in range(3):  # its prefix, cached nowhere now: served by the group that is left
        _complete(url, TENANT + f"After the kill {i}?")
    after = _served(cluster, ns)
    assert {g: after[g] - before[g] for g in GROUPS} == {home: 0, other: 3}
