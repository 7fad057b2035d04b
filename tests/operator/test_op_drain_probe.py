"""Drain progress read from rank 0's /metrics: the engine's own exposition parsed, and the probe
tasks asking for a pass only when the count changes. The reads are faked by an injected fetch."""

from __future__ import annotations

import asyncio

from shoal.engine.frontend.metrics import FrontendMetrics
from shoal.operator.drain_probe import DrainProbes, in_flight


def test_in_flight_counts_running_and_waiting_requests_in_the_engines_own_metrics():
    m = FrontendMetrics("tiny")
    m.running.set(3)
    m.waiting.set(2)
    assert in_flight(m.render().decode()) == 5


def test_a_page_without_the_metrics_has_no_count():
    assert in_flight("# HELP x\nprocess_cpu_seconds_total 1.0\n") is None


class FakeEngine:
    """Answers /metrics with the next count of a script; then keeps the last one."""

    def __init__(self, counts):
        self.counts, self.reads = list(counts), 0

    async def fetch(self, url: str) -> str:
        self.reads += 1
        n = self.counts.pop(0) if len(self.counts) > 1 else self.counts[0]
        if n is None:
            raise ConnectionRefusedError(url)
        return f'vllm:num_requests_running{{engine="0",model_name="tiny"}} {n}.0\n'


async def _until(pred, timeout=5.0):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not pred():
        assert loop.time() < end, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_a_pass_is_asked_for_only_when_the_count_changes():
    engine = FakeEngine([None, 4, 4, 4, 2, 2, 0])
    asked = []
    probes = DrainProbes(on_change=asked.append, fetch=engine.fetch, interval=0.01)
    probes.bind(asyncio.get_running_loop())
    probes.follow("ns", "llm", {1: "http://10.0.0.1:8000/metrics"})
    await _until(lambda: engine.reads >= 10)
    assert asked == [("ns", "llm")] * 3, (
        "4, 2 and 0: one pass per new count, none for a failed read"
    )
    assert probes.counts("ns", "llm") == {1: 0} and probes.counts("ns", "other") == {}

    probes.follow("ns", "llm", {})  # the drain ended: the probe stops, its count goes
    await _until(lambda: asyncio.all_tasks() == {asyncio.current_task()})  # no probe task left
    assert probes.counts("ns", "llm") == {}
