"""What an engine says about its own load, from vLLM's gauges on its /metrics, for `kv-aware`
scoring (kv_score.py): every frontend replica and the gateway send to the same engines, so the
engine's own count of running and waiting requests sees what one router's outstanding count
cannot, and its KV usage says how close it is to preempting.

The health prober (health.py) reads it after each good /health of a kv-aware router; a number
older than FRESH_S (or a failed read) is not used."""

from __future__ import annotations

import re
from dataclasses import dataclass

FRESH_S = 6.0  # three probe rounds
GAUGES = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
          "vllm:kv_cache_usage_perc": "kv_usage"}
_SAMPLE = re.compile(r"^(vllm:[a-z_]+)(?:\{[^}]*\})? ([0-9.eE+-]+|NaN)$")


@dataclass(frozen=True)
class EngineLoad:
    running: float
    waiting: float
    kv_usage: float  # 0..1
    at: float  # the router's monotonic clock when read

    @property
    def requests(self) -> float:
        return self.running + self.waiting


def parse(text: str, at: float) -> EngineLoad | None:
    """The gauges summed over their label sets (one engine per rank-0 server; a data-parallel
    server lists several); None when the text has none of them."""
    found = {field: 0.0 for field in GAUGES.values()}
    seen = False
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) in GAUGES and m.group(2) != "NaN":
            found[GAUGES[m.group(1)]] += float(m.group(2))
            seen = True
    return EngineLoad(at=at, **found) if seen else None


def fresh(load: EngineLoad | None, now: float) -> EngineLoad | None:
    return load if load is not None and now - load.at <= FRESH_S else None
