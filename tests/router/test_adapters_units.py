"""adapters.py's readers fed by the engine's own renderings (its FrontendMetrics' lora gauge,
vLLM's names), and the rule that picks an adapter's groups."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from shoal.router import adapters
from shoal.router.discovery import Group

G = [Group(i, f"http://g{i}:8000") for i in range(3)]


@dataclass
class State:
    group: Group
    outstanding: int
    adapters: dict | None
    resident: frozenset = frozenset()


def test_running_reads_the_newest_series_of_the_engines_own_gauge():
    from shoal.engine.frontend.metrics import FrontendMetrics
    from shoal.engine.wire import SchedulerStats

    m = FrontendMetrics("tiny", max_loras=2)
    m.record_step(SchedulerStats(running_lora_adapters={"a1": 2, "b": 1},
                                 waiting_lora_adapters={"c": 1}), now=1.0)
    assert adapters.running(m.render().decode()) == {"a1", "b"}
    m.record_step(SchedulerStats(running_lora_adapters={}, waiting_lora_adapters={}), now=2.0)
    assert adapters.running(m.render().decode()) == frozenset()
    assert adapters.running("vllm:num_requests_running 1\n") == frozenset()


def test_running_reads_the_series_the_prober_asks_for_alone():
    """health.py asks /metrics for INFO_METRIC by name (`name[]`): the engine's filtered text."""
    from shoal.engine.frontend.metrics import FrontendMetrics
    from shoal.engine.wire import SchedulerStats

    m = FrontendMetrics("tiny", max_loras=2)
    m.record_step(SchedulerStats(running_lora_adapters={"a1": 1}, waiting_lora_adapters={}),
                  now=1.0)
    text = m.render([adapters.INFO_METRIC]).decode()
    assert adapters.running(text) == {"a1"}
    assert {x.split("{")[0] for x in text.splitlines() if not x.startswith("#")} == \
        {adapters.INFO_METRIC}


def test_listed_takes_the_cards_with_a_parent():
    body = {"object": "list", "data": [
        {"id": "tiny", "parent": None, "root": "/m"},
        {"id": "a1", "parent": "tiny", "root": "/a1"}]}
    assert adapters.listed(json.dumps(body)) == {"a1": "tiny"}
    assert adapters.listed("not json") is None and adapters.listed("{}") is None


def test_a_name_is_the_routers_404_once_any_list_was_read():
    assert not adapters.read_any([State(G[0], 0, None), State(G[1], 0, None)])
    assert adapters.read_any([State(G[0], 0, None), State(G[1], 0, {})])  # none loaded yet


@pytest.mark.parametrize("name, states, expected", [
    ("only the groups that list it", [State(G[0], 5, {"a": "m"}), State(G[1], 0, {}),
                                       State(G[2], 0, None)], {0}),
    ("those running it, when within the bound", [State(G[0], 3, {"a": "m"}, frozenset({"a"})),
                                                  State(G[1], 0, {"a": "m"})], {0}),
    ("all that list it, when the warm one is too busy",
     [State(G[0], 9, {"a": "m"}, frozenset({"a"})), State(G[1], 0, {"a": "m"})], {0, 1}),
    ("none lists it", [State(G[0], 0, {"b": "m"}), State(G[1], 0, None)], set()),
])
def test_groups_for(name, states, expected):
    assert adapters.groups_for("a", states) == {G[i].key for i in expected}, name


def test_model_of_and_known():
    assert adapters.model_of(b'{"model": "a", "prompt": "x"}') == "a"
    assert adapters.model_of(b"[1]") is None and adapters.model_of(b"{") is None
    states = [State(G[0], 0, {"a": "m"}), State(G[1], 0, None)]
    assert adapters.known(states) == {"a": "m"}
    assert adapters.model_cards({"m": "/path"}, {"a": "m"}) == [("m", "/path", None),
                                                                ("a", "a", "m")]


class _Engines:
    """Each group's /v1/models as the router's own model_list renders a listing (adapters
    under their parent), answered after `delay`; counts the reads; a group in `down` fails."""

    def __init__(self, delay: float = 0.05) -> None:
        self.lists = {g.url: {} for g in G}
        self.reads = 0
        self.down: set[str] = set()
        self.delay = delay

    async def handle(self, request):
        import asyncio

        import httpx
        from shoal.router.app import model_list

        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        if request.url.path == "/v1/models":
            self.reads += 1
            await asyncio.sleep(self.delay)
            if base in self.down:
                return httpx.Response(503)
            rows = [("tiny", "/m")] + [(n, n, p) for n, p in self.lists[base].items()]
            return httpx.Response(200, json=model_list(rows, 0))
        return httpx.Response(404)


def _prober(engines: _Engines):
    import httpx
    from shoal.router.health import HealthProber
    from shoal.router.picker import GroupPicker

    picker = GroupPicker()
    picker.set_groups(G)
    client = httpx.AsyncClient(transport=httpx.MockTransport(engines.handle))
    return picker, HealthProber(picker, client)


def test_a_reread_is_one_read_that_began_after_the_call():
    """Callers that ask while a read is in flight wait for it only if it began after they
    asked; otherwise one more read follows, shared by every caller that was waiting."""
    import asyncio

    engines = _Engines(delay=0.1)
    picker, prober = _prober(engines)

    async def scenario():
        first = asyncio.ensure_future(prober.reread())
        await asyncio.sleep(0.02)  # the first read is in flight
        engines.lists[G[1].url] = {"a9": "tiny"}  # loaded after that read began
        late = [asyncio.ensure_future(prober.reread()) for _ in range(5)]
        await asyncio.gather(first, *late)

    asyncio.run(scenario())
    assert engines.reads == 2 * len(G)  # one read for the first caller, one for the five
    assert picker.states[G[1].key].adapters == {"a9": "tiny"}


def test_a_failed_list_read_keeps_the_groups_last_list():
    import asyncio

    engines = _Engines()
    engines.lists[G[0].url] = {"a1": "tiny"}
    picker, prober = _prober(engines)
    asyncio.run(prober.reread())
    engines.down.add(G[0].url)
    asyncio.run(prober.reread())
    assert picker.states[G[0].key].adapters == {"a1": "tiny"}
    picker.set_groups([Group(0, "http://g0-moved:8000"), *G[1:]])  # a new address: unread
    assert picker.states[G[0].key].adapters is None


@pytest.mark.parametrize("model, lists, after_read, kind, reads", [
    (None, [None], [None], adapters.SERVED, 0),
    ("tiny", [{}], [{}], adapters.SERVED, 0),
    ("a1", [{"a1": "tiny"}, None], None, adapters.ADAPTER, 0),
    # no list read yet (a group just came back): read now, then the router's own 404
    ("a1", [None, None], [{}, None], adapters.UNKNOWN, 1),
    # loaded since the lists were read
    ("a1", [{}, {}], [{}, {"a1": "tiny"}], adapters.ADAPTER, 1),
    ("a1", [{}, {}], [{}, {}], adapters.UNKNOWN, 1),
    # no list can be read: the request passes on, the engine answers for its names
    ("a1", [None, None], [None, None], adapters.UNREAD, 1),
])
def test_lookup_reads_the_lists_again_before_a_name_is_unknown(model, lists, after_read, kind,
                                                                reads):
    import asyncio

    states = [State(G[i], 0, a) for i, a in enumerate(lists)]
    done = []

    async def reread():
        done.append(1)
        for s, a in zip(states, after_read, strict=True):
            s.adapters = a

    assert asyncio.run(adapters.lookup(model, {"tiny"}, states, reread)) == kind
    assert len(done) == reads
