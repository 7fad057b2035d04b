"""The autoscaler's reads: rank 0's /metrics of every ready group of an engine, at most once
per PERIOD_SECONDS per engine, the groups in parallel, each read bounded by TIMEOUT_SECONDS,
so a pass waits at most that long for its engines. A group that does not answer (or answers
no vLLM gauge) gets None: autoscale.decide() then holds, it never counts it as idle.

Each group's last TTFT histogram is kept here (not in status: it is per scrape and large), so a
sample carries the first tokens since the previous read; an operator restart loses it and the
first TTFT decision after one waits a scrape. Standard library HTTP: no new dependency.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from shoal.operator.autoscale import PERIOD_SECONDS
from shoal.operator.autoscale_metrics import Buckets, Sample, histogram_delta, parse

log = logging.getLogger("shoal.operator.autoscale")

TIMEOUT_SECONDS = 1.0
EARLY_SECONDS = 1.0  # a pass this close before the next read is due reads already
MAX_PARALLEL = 8

Fetch = Callable[[str], str]
# (namespace, engine, group -> rank 0's /metrics URL) -> group -> sample, or None: not due
Scrape = Callable[[str, str, dict[int, str]], "dict[int, Sample | None] | None"]


def fetch_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=TIMEOUT_SECONDS) as r:  # noqa: S310 - pod IPs
        return r.read().decode("utf-8", "replace")


class Scraper:
    def __init__(self, fetch: Fetch = fetch_text, clock: Callable[[], float] = time.monotonic):
        self._fetch, self._clock = fetch, clock
        self._at: dict[tuple[str, str], float] = {}
        self._ttft: dict[tuple[str, str, int, str], Buckets] = {}  # last histogram per group
        self._lock = threading.Lock()

    def __call__(self, namespace: str, name: str,
                 targets: dict[int, str]) -> dict[int, Sample | None] | None:
        key = (namespace, name)
        now = self._clock()
        with self._lock:
            last = self._at.get(key)
            if last is not None and now - last < PERIOD_SECONDS - EARLY_SECONDS:
                return None
            self._at[key] = now
        texts = self._read_all(key, targets)
        out: dict[int, Sample | None] = {}
        with self._lock:
            for k in [k for k in self._ttft if k[:2] == key and targets.get(k[2]) != k[3]]:
                del self._ttft[k]
            for g, text in texts.items():
                reading = parse(text) if text is not None else None
                if reading is None:
                    out[g] = None
                    continue
                hkey = (*key, g, targets[g])
                delta = histogram_delta(reading.ttft_total, self._ttft.get(hkey))
                self._ttft[hkey] = reading.ttft_total
                out[g] = Sample(running=reading.running, waiting=reading.waiting,
                                kv_usage=reading.kv_usage, ttft=delta)
        return out

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._at.pop((namespace, name), None)
            for k in [k for k in self._ttft if k[:2] == (namespace, name)]:
                del self._ttft[k]

    def _read_all(self, key: tuple[str, str], targets: dict[int, str]) -> dict[int, str | None]:
        if not targets:
            return {}

        def one(url: str) -> str | None:
            try:
                return self._fetch(url)
            except Exception as e:  # noqa: BLE001 - a group that does not answer has no sample
                log.info("%s/%s: no metrics from %s: %s", *key, url, e)
                return None

        with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL, len(targets))) as pool:
            futures = {g: pool.submit(one, url) for g, url in targets.items()}
            return {g: f.result() for g, f in futures.items()}
