"""What the autoscaler reads from rank 0's /metrics: parsed from the text the engine really
serves (shoal.engine's FrontendMetrics, vLLM's names and buckets), the TTFT p90 from histogram
deltas, and the scraper's cadence and failures."""

from __future__ import annotations

import math

import pytest
from shoal.engine.frontend.metrics import FrontendMetrics
from shoal.operator.autoscale import PERIOD_SECONDS
from shoal.operator.autoscale_metrics import histogram_delta, merge, parse, quantile
from shoal.operator.autoscale_scrape import Scraper


def engine_text(running=0, waiting=0, kv=0.0, ttfts=()) -> tuple[FrontendMetrics, str]:
    m = FrontendMetrics("tiny")
    m.running.set(running)
    m.waiting.set(waiting)
    m.kv_usage.set(kv)
    for t in ttfts:
        m.ttft.observe(t)
    return m, m.render().decode()


def test_the_engines_own_metrics_text_parses():
    _, text = engine_text(running=3, waiting=2, kv=0.42, ttfts=(0.3, 0.3, 1.5))
    r = parse(text)
    assert (r.running, r.waiting, r.kv_usage) == (3, 2, 0.42)
    counts = dict(r.ttft_total)
    assert counts[0.25] == 0 and counts[0.5] == 2 and counts[2.5] == 3 and counts[math.inf] == 3


def test_text_without_the_gauges_is_no_reading():
    assert parse("# HELP up\nup 1\n") is None
    assert parse("") is None


def test_deltas_between_scrapes_and_the_p90_of_the_interval():
    m, before = engine_text(ttfts=[0.05] * 100)  # an earlier interval, all fast
    for _ in range(9):
        m.ttft.observe(0.3)
    m.ttft.observe(4.0)
    now = parse(m.render().decode()).ttft_total
    delta = histogram_delta(now, parse(before).ttft_total)
    assert dict(delta)[math.inf] == 10  # only this interval's ten first tokens
    assert 0.25 < quantile(0.9, delta) <= 0.5  # 9 of 10 under 0.5 s: p90 inside that bucket
    assert quantile(0.99, delta) > 2.5
    assert quantile(0.9, histogram_delta(now, now)) is None  # nothing new: no value


def test_a_restarted_engine_counts_from_zero_and_a_first_scrape_has_no_delta():
    _, big = engine_text(ttfts=[0.3] * 50)
    _, small = engine_text(ttfts=[2.0] * 3)
    assert histogram_delta(parse(small).ttft_total, parse(big).ttft_total) == parse(
        small).ttft_total
    assert histogram_delta(parse(small).ttft_total, None) == ()


@pytest.mark.parametrize("buckets, q, want", [
    (((1.0, 0.0), (2.0, 10.0), (math.inf, 10.0)), 0.5, 1.5),
    (((1.0, 10.0), (math.inf, 10.0)), 0.9, 0.9),
    (((1.0, 5.0), (math.inf, 10.0)), 0.9, 1.0),  # in +Inf: the highest finite bound
    ((), 0.9, None), (((1.0, 0.0), (math.inf, 0.0)), 0.9, None)])
def test_quantile_as_prometheus_computes_it(buckets, q, want):
    assert quantile(q, buckets) == (pytest.approx(want) if want is not None else None)


def test_merge_adds_groups():
    a = ((1.0, 1.0), (math.inf, 2.0))
    assert merge([a, a]) == ((1.0, 2.0), (math.inf, 4.0))


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_the_scraper_reads_once_per_period_and_a_silent_group_has_no_sample():
    m, _ = engine_text(running=4, ttfts=[0.1])
    texts = {"http://a/metrics": lambda: m.render().decode()}
    reads = []

    def fetch(url):
        reads.append(url)
        if url not in texts:
            raise ConnectionRefusedError(url)
        return texts[url]()

    clock = Clock()
    s = Scraper(fetch=fetch, clock=clock)
    targets = {0: "http://a/metrics", 1: "http://b/metrics"}
    first = s("ns", "llm", targets)
    assert first[0].running == 4 and first[0].ttft == () and first[1] is None
    clock.t += 5
    assert s("ns", "llm", targets) is None, "not due: no read"
    assert len(reads) == 2
    m.ttft.observe(0.7)
    m.ttft.observe(0.8)
    clock.t += PERIOD_SECONDS
    second = s("ns", "llm", targets)
    assert dict(second[0].ttft)[math.inf] == 2, "the first tokens since the last read"
    assert s("ns", "other", {}) == {}, "each engine has its own cadence"
