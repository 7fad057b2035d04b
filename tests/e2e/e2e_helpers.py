"""What the e2e tests share: waiting on an InferenceEngine's status, reaching its Service from
the host, streams that run in threads, the frontends' metrics, and a record of measurements
(`$SHOAL_CACHE/cluster/e2e-measurements.jsonl`, read by benchmarks/cluster.py)."""

from __future__ import annotations

import json
import os
import re
import threading
import time
import urllib.request
from pathlib import Path

from openai import OpenAI, Timeout
from support.cluster import Cluster, inference_engine
from support.wait import wait_for

MODEL = "shoal-tiny"


def record(name: str, seconds: float, **extra) -> None:
    path = Path(os.environ.get("SHOAL_CACHE", Path.home() / ".cache" / "shoal")) / "cluster" / \
        "e2e-measurements.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps({"name": name, "seconds": round(seconds, 2), "time": time.time(),
                            **extra}) + "\n")
    print(f"measured {name}: {seconds:.1f}s {extra or ''}")


def create(cluster: Cluster, ns: str, name: str, **kw) -> dict:
    body = inference_engine(name, **kw)
    body["metadata"]["namespace"] = ns
    cluster.apply(body)
    return body


def ie(cluster: Cluster, ns: str, name: str) -> dict:
    return cluster.get("ie", name, "-n", ns)


def status(cluster: Cluster, ns: str, name: str) -> dict:
    return ie(cluster, ns, name).get("status") or {}


def wait_ready(cluster: Cluster, ns: str, name: str, ready: str, timeout: float = 420) -> dict:
    def check():
        st = status(cluster, ns, name)
        return st if st.get("phase") == "Ready" and st.get("ready") == ready else None

    return wait_for(check, timeout=timeout, interval=1,
                    what=f"InferenceEngine {ns}/{name} Ready {ready}")


def service_url(cluster: Cluster, ns: str, name: str) -> str:
    ip = cluster.get("service", name, "-n", ns)["spec"]["clusterIP"]
    return f"http://{ip}:8000/v1"


def client(url: str, timeout: float | Timeout = 120) -> OpenAI:
    return OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=timeout)


def completes(url: str) -> bool:
    try:
        out = client(url, timeout=30).completions.create(model=MODEL, prompt="hello",
                                                          max_tokens=4)
        return bool(out.choices)
    except Exception:  # noqa: BLE001 - "not yet"
        return False


def wait_serving(url: str, timeout: float = 300) -> None:
    wait_for(lambda: completes(url), timeout=timeout, interval=0.5,
             what=f"a completion through {url}")


class Stream(threading.Thread):
    """One streamed completion in a thread: its tokens and its finish_reason."""

    def __init__(self, url: str, max_tokens: int = 600) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.chunks = 0
        self.finish_reason: str | None = None
        self.error: Exception | None = None
        self.started_tokens = threading.Event()

    def run(self) -> None:
        try:
            stream = client(self.url, timeout=300).completions.create(
                model=MODEL, prompt="Once upon a time", max_tokens=self.max_tokens, stream=True,
                extra_body={"ignore_eos": True})
            for chunk in stream:
                self.chunks += 1
                self.started_tokens.set()
                for choice in chunk.choices:
                    if choice.finish_reason:
                        self.finish_reason = choice.finish_reason
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            self.error = exc
        finally:
            self.started_tokens.set()


def pods(cluster: Cluster, ns: str, selector: str) -> list[dict]:
    return cluster.get("pods", "-n", ns, "-l", selector)["items"]


def frontend_metrics(cluster: Cluster, ns: str, name: str) -> dict[str, float]:
    """The frontends' Prometheus samples, summed over frontend pods (scraped by pod IP)."""
    total: dict[str, float] = {}
    for pod in pods(cluster, ns, f"shoal.dev/engine={name},shoal.dev/component=frontend"):
        ip = pod["status"].get("podIP")
        if not ip or pod["metadata"].get("deletionTimestamp"):
            continue
        with urllib.request.urlopen(f"http://{ip}:8000/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                m = re.match(r"^(shoal_router_[a-z_]+(?:\{[^}]*\})?) ([0-9.e+-]+)$", line)
                if m:
                    total[m.group(1)] = total.get(m.group(1), 0.0) + float(m.group(2))
    return total


def group_metric(samples: dict[str, float], metric: str, group: int, **labels: str) -> float:
    out = 0.0
    for key, val in samples.items():
        if not key.startswith(metric + "{") or f'group="{group}"' not in key:
            continue
        if all(f'{k}="{v}"' in key for k, v in labels.items()):
            out += val
    return out


def events(cluster: Cluster, ns: str, reason: str, name: str | None = None) -> list[dict]:
    """Events of `reason` in `ns`, of one InferenceEngine if `name` is given."""
    items = cluster.get("events", "-n", ns)["items"]
    return [e for e in items if e.get("reason") == reason
            and (name is None or (e.get("involvedObject") or {}).get("name") == name)]


def iso_seconds(stamp: str | None) -> float | None:
    """An API timestamp as epoch seconds (the API's resolution is 1 s)."""
    import calendar

    return calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ")) if stamp else None


def condition_time(obj: dict, ctype: str, status: str = "True") -> float | None:
    """When a condition last became `status` (epoch seconds; the API's resolution is 1 s)."""
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c["type"] == ctype and c["status"] == status and c.get("lastTransitionTime"):
            return iso_seconds(c["lastTransitionTime"])
    return None


def kill9_engine_core(cluster: Cluster, ns: str, pod: str) -> None:
    """SIGKILL the EngineCore process inside `pod`'s engine container (Shoal's image)."""
    kill = ("import os, signal\n"
            "pids = [int(p) for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid()"
            " and b'engine_core_proc' in open(f'/proc/{p}/cmdline', 'rb').read()]\n"
            "assert pids, 'no EngineCore process'\n"
            "[os.kill(p, signal.SIGKILL) for p in pids]\nprint(pids)\n")
    cluster.kubectl("exec", "-n", ns, pod, "-c", "engine", "--", "python3", "-c", kill)
