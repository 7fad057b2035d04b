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
    ours: float = 0.0  # the most requests this router had in flight on the engine during the read

    @property
    def requests(self) -> float:
        return self.running + self.waiting

    @property
    def others(self) -> float:
        """The requests other routers had on the engine when it was read. The engine counts
        ours too; those the router tracks itself, to the moment. `ours` is the most of them
        in flight at any instant of the read (the gauges are the last step's, which may count
        one of ours that has finished since the read began, or not yet one just sent), so a
        router alone in front of its engines sees no others: the engine never runs more of its
        requests than it has in flight."""
        return max(0.0, self.requests - self.ours)


def parse(text: str, at: float, ours: float = 0.0) -> EngineLoad | None:
    """The gauges summed over their label sets (one engine per rank-0 server; a data-parallel
    server lists several); None when the text has none of them. `ours`: EngineLoad.ours."""
    found = {field: 0.0 for field in GAUGES.values()}
    seen = False
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) in GAUGES and m.group(2) != "NaN":
            found[GAUGES[m.group(1)]] += float(m.group(2))
            seen = True
    return EngineLoad(at=at, ours=ours, **found) if seen else None


def fresh(load: EngineLoad | None, now: float) -> EngineLoad | None:
    return load if load is not None and now - load.at <= FRESH_S else None
