"""What the autoscaler reads from a group's rank 0 /metrics: vLLM's load gauges and its TTFT
histogram, as a `Sample`. Pure functions over the Prometheus text, no I/O (autoscale_scrape.py
reads it).

The router has its own parser of the same gauges (router/shoal/router/engine_load.py); the
operator may not import the router (import-linter), and needs the histogram besides.

TTFT is a cumulative histogram: one scrape says nothing about now, so a sample carries the
bucket counts added since the group's previous scrape (`histogram_delta`), and the p90 of the
first tokens of that interval is read from them the way Prometheus' histogram_quantile does.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
TTFT_BUCKET = "vllm:time_to_first_token_seconds_bucket"
GAUGES = {RUNNING: "running", WAITING: "waiting", KV_USAGE: "kv_usage"}

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LE = re.compile(r'le="([^"]+)"')

# (upper bound, cumulative count) per bucket, ascending, +Inf last
Buckets = tuple[tuple[float, float], ...]


@dataclass(frozen=True)
class Sample:
    """One group's load as its rank 0 reported it (gauges summed over label sets: a
    data-parallel server lists several engines). `ttft` holds the first tokens since the
    group's previous scrape, by bucket; () when none or no previous scrape."""

    running: float
    waiting: float
    kv_usage: float  # 0..1
    ttft: Buckets = ()

    @property
    def requests(self) -> float:
        return self.running + self.waiting


@dataclass(frozen=True)
class Reading:
    """A parsed /metrics text: the gauges and the TTFT histogram as it stands (cumulative)."""

    running: float
    waiting: float
    kv_usage: float
    ttft_total: Buckets


def parse(text: str) -> Reading | None:
    """The gauges and TTFT buckets of a /metrics text; None when it has none of the gauges
    (not a vLLM-compatible engine, or not one yet)."""
    found = {f: 0.0 for f in GAUGES.values()}
    buckets: dict[float, float] = {}
    seen = False
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        name, labels, raw = m.groups()
        try:
            value = float(raw)
        except ValueError:
            continue
        if math.isnan(value):
            continue
        if name in GAUGES:
            found[GAUGES[name]] += value
            seen = True
        elif name == TTFT_BUCKET and labels and (le := _LE.search(labels)):
            bound = float(le.group(1))  # "+Inf" parses as inf
            buckets[bound] = buckets.get(bound, 0.0) + value
    if not seen:
        return None
    return Reading(ttft_total=tuple(sorted(buckets.items())), **found)


def histogram_delta(now: Buckets, before: Buckets | None) -> Buckets:
    """What was added to a cumulative histogram between two scrapes: () without a previous
    scrape of the same buckets; `now` itself when a count went down (the engine restarted,
    so everything it counts is new)."""
    if before is None:
        return ()
    prev = dict(before)
    if set(prev) != {b for b, _ in now}:
        return ()
    delta = tuple((b, c - prev[b]) for b, c in now)
    return now if any(c < 0 for _, c in delta) else delta


def merge(histograms: Iterable[Buckets]) -> Buckets:
    """Bucket counts added over groups (same bounds: one engine build); () if none."""
    total: dict[float, float] = {}
    for h in histograms:
        for b, c in h:
            total[b] = total.get(b, 0.0) + c
    return tuple(sorted(total.items()))


def quantile(q: float, buckets: Buckets) -> float | None:
    """The q-quantile of a cumulative histogram, interpolated linearly inside its bucket
    (Prometheus' histogram_quantile); None when it counts nothing. A quantile in the +Inf
    bucket is the highest finite bound (the histogram knows no more)."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, count
    return lower
