"""The gateway's `vllm:*` series: every listed group's own `/metrics`, summed per model.

Each group's rank 0 exports vLLM's series labelled with `model_name` (and vLLM's `engine`
index); samples with the same name and labels across groups are added up, so the gateway's
`/metrics` has vLLM's names and labels, one series per model (two engines that serve the same
model name count together). Counters, histogram buckets/sums/counts and gauges of amounts
(`vllm:num_requests_running`, `..._waiting`) add up; fractions (gauges named `*_perc`) are the
mean over the groups that report them; `_created` timestamps are left out. A group whose
`/metrics` does not answer within SCRAPE_TIMEOUT_S is left out of that scrape.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import httpx
from prometheus_client.parser import text_string_to_metric_families

PREFIX = "vllm:"
SCRAPE_TIMEOUT_S = 2.0


async def scrape(client: httpx.AsyncClient, urls: Iterable[str]) -> list[str]:
    """The `/metrics` text of each base URL that answered 200 in time."""

    async def one(url: str) -> str | None:
        try:
            r = await client.get(f"{url}/metrics", timeout=SCRAPE_TIMEOUT_S)
        except httpx.HTTPError:
            return None
        return r.text if r.status_code == 200 else None

    return [t for t in await asyncio.gather(*(one(u) for u in urls)) if t is not None]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt(value: float) -> str:
    if value == float("inf"):
        return "+Inf"
    return repr(float(value))


def aggregate(texts: Iterable[str]) -> str:
    """Prometheus text of the `vllm:*` families in `texts`, same-labelled samples combined."""
    families: dict[str, tuple[str, str]] = {}  # name -> (type, help), first-seen order
    sums: dict[str, dict[tuple, list[float]]] = {}  # family -> sample key -> values
    for text in texts:
        for fam in text_string_to_metric_families(text):
            if not fam.name.startswith(PREFIX):
                continue
            families.setdefault(fam.name, (fam.type, fam.documentation))
            samples = sums.setdefault(fam.name, {})
            for s in fam.samples:
                if s.name.endswith("_created"):
                    continue
                key = (s.name, tuple(sorted(s.labels.items())))
                samples.setdefault(key, []).append(s.value)
    out = []
    for name, (kind, doc) in families.items():
        out.append(f"# HELP {name} {doc}")
        out.append(f"# TYPE {name} {kind}")
        mean = kind == "gauge" and name.endswith("_perc")
        for (sample, labels), values in sums[name].items():
            value = sum(values) / len(values) if mean else sum(values)
            text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
            out.append(f"{sample}{{{text}}} {_fmt(value)}" if text else f"{sample} {_fmt(value)}")
    return "\n".join(out) + ("\n" if out else "")
