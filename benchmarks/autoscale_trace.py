"""A bursty trace (idle, ramp, plateau, spike, idle) against one InferenceEngine on the local
cluster (docs/cluster.md), three ways: a fixed `maxReplicas` groups; the operator's own
autoscaler (`spec.autoscaling`, minReplicas 0: the trace starts at zero); and a queue-depth rule
of the kind users write for KEDA (desired = ceil((running + waiting) / target), at least 1,
from the same rank-0 /metrics every 15 s, scale-down after the same delay), run here as a loop
that sets `spec.replicas`. Prints a markdown table: replica-seconds (groups with an engine pod,
starting ones included, sampled about once a second, each sample weighted by its interval),
TTFT p50/p90 of the trace's streamed requests,
failed requests (429/503 and errors), scale events and direction changes, and the first token
from zero.

    sudo PYTHONPATH=tests .venv/bin/python benchmarks/autoscale_trace.py [--modes fixed,auto,queue]

Uses a running cluster (make cluster) or starts one. The tiny model's groups share this
machine's two cores, so more groups add no compute here: TTFT is compared only as a bound.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import threading
import time
import urllib.request

from bench_cluster import local_cluster
from e2e.e2e_helpers import MODEL, client, create, pods, service_url, status, wait_ready
from shoal.devcluster import cluster as devcluster
from support.cluster import Cluster
from support.wait import wait_for

MAX = 3
TARGET = 2  # requests running + waiting per group, for both rules
DOWN_S = 30  # scale-down delay of both rules
UP_S = 5
# (phase, seconds, concurrent streaming clients at its start, at its end)
TRACE = [("idle", 20, 0, 0), ("ramp", 45, 1, 6), ("plateau", 45, 6, 6), ("spike", 30, 12, 12),
         ("idle", 90, 0, 0)]
ENGINE = "shoal.dev/component=engine"


def concurrency(t: float) -> int:
    start = 0.0
    for _, secs, a, b in TRACE:
        if t < start + secs:
            return round(a + (b - a) * (t - start) / secs)
        start += secs
    return 0


class Clients:
    """Up to 12 client threads; thread i sends streamed requests while i < concurrency(t)."""

    def __init__(self, url: str) -> None:
        self.url, self.t0 = url, time.monotonic()
        self.ttft: list[float] = []
        self.failed: list[str] = []
        self.first_from_zero: float | None = None
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.loop, args=(i,), daemon=True)
                        for i in range(12)]

    def run(self) -> None:
        for th in self.threads:
            th.start()

    def loop(self, i: int) -> None:
        oai = client(self.url, timeout=200)
        while not self.stop.is_set():
            if i >= concurrency(time.monotonic() - self.t0):
                time.sleep(0.2)
                continue
            sent = time.monotonic()
            try:
                first, finish = None, None
                # ignore_eos: every request streams 32 tokens (a sampled EOS first would end
                # one with no text, which is not a failure of the routing)
                for chunk in oai.completions.create(model=MODEL, prompt=f"Client {i} says",
                                                    max_tokens=32, stream=True,
                                                    extra_body={"ignore_eos": True}):
                    if first is None and chunk.choices and chunk.choices[0].text:
                        first = time.monotonic() - sent
                    if chunk.choices and chunk.choices[0].finish_reason:
                        finish = chunk.choices[0].finish_reason
                if first is None or finish != "length":
                    raise RuntimeError(f"no token or cut short (finish_reason {finish})")
                self.ttft.append(first)
                if self.first_from_zero is None:
                    self.first_from_zero = first
            except Exception as e:  # noqa: BLE001 - counted
                self.failed.append(f"{type(e).__name__}: {str(e)[:80]}")


def rank0_load(c: Cluster, ns: str, name: str) -> float | None:
    """running + waiting over the Ready rank-0 pods (their /metrics), None if one is silent."""
    total = 0.0
    for p in pods(c, ns, f"shoal.dev/engine={name},{ENGINE}"):
        ready = any(x["type"] == "Ready" and x["status"] == "True"
                    for x in p["status"].get("conditions") or [])
        if not ready or p["metadata"]["labels"].get("shoal.dev/rank") != "0":
            continue
        try:
            with urllib.request.urlopen(f"http://{p['status']['podIP']}:8000/metrics",
                                        timeout=2) as r:
                text = r.read().decode()
        except OSError:
            return None
        for line in text.splitlines():
            if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
                total += float(line.rsplit(" ", 1)[1])
    return total


def queue_rule(c: Cluster, ns: str, name: str, stop: threading.Event) -> None:
    """KEDA-style: every 15 s, desired = clamp(ceil(load / TARGET), 1, MAX); up at once, down
    only after it was lower for DOWN_S (HPA's scale-down stabilization)."""
    current, low_since = 1, None
    while not stop.wait(15):
        load = rank0_load(c, ns, name)
        if load is None:
            continue
        want = min(MAX, max(1, math.ceil(load / TARGET)))
        if want > current:
            current, low_since = want, None
        elif want < current:
            low_since = low_since or time.monotonic()
            if time.monotonic() - low_since >= DOWN_S:
                current, low_since = want, None
        else:
            low_since = None
        c.kubectl("patch", "ie", name, "-n", ns, "--type", "merge", "-p",
                  json.dumps({"spec": {"replicas": current}}))


def run_mode(c: Cluster, ns: str, mode: str) -> dict:
    name = f"trace-{mode}"
    spec = {"fixed": {"replicas": MAX}, "queue": {"replicas": 1},
            "auto": {"replicas": 1, "autoscaling": {
                "minReplicas": 0, "maxReplicas": MAX, "requestsPerGroup": TARGET,
                "scaleUpStabilizationSeconds": UP_S, "scaleDownDelaySeconds": DOWN_S}}}[mode]
    create(c, ns, name, shutdown_s=30, **spec)
    wait_ready(c, ns, name, f"{spec['replicas']}/{spec['replicas']}", timeout=420)
    url = service_url(c, ns, name)
    if mode == "auto":  # the trace starts at zero
        wait_for(lambda: not pods(c, ns, f"shoal.dev/engine={name},{ENGINE}"), timeout=300,
                 interval=1, what="scaled to zero")
    clients, stop = Clients(url), threading.Event()
    rule = threading.Thread(target=queue_rule, args=(c, ns, name, stop), daemon=True)
    if mode == "queue":
        rule.start()
    counts: list[int] = []
    replica_s, last = 0.0, time.monotonic()
    clients.run()
    total = sum(s for _, s, _, _ in TRACE)
    while time.monotonic() - clients.t0 < total:
        counts.append(len({p["metadata"]["labels"]["shoal.dev/group"]
                           for p in pods(c, ns, f"shoal.dev/engine={name},{ENGINE}")}))
        time.sleep(1)
        now = time.monotonic()
        replica_s, last = replica_s + counts[-1] * (now - last), now
    clients.stop.set()
    stop.set()
    for th in clients.threads:
        th.join(120)
    changes = [b - a for a, b in zip(counts, counts[1:], strict=False) if b != a]
    turns = sum(1 for a, b in zip(changes, changes[1:], strict=False) if (a > 0) != (b > 0))
    st = status(c, ns, name)
    c.kubectl("delete", "ie", name, "-n", ns, "--wait=false")
    q = statistics.quantiles(clients.ttft, n=10) if len(clients.ttft) > 1 else [0] * 9
    return {"mode": mode, "replica_s": round(replica_s), "requests": len(clients.ttft),
            "ttft_p50": statistics.median(clients.ttft) if clients.ttft else 0, "ttft_p90": q[8],
            "failed": len(clients.failed), "failures": sorted(set(clients.failed))[:3],
            "scale_events": len(changes), "direction_changes": turns,
            "first_from_zero": clients.first_from_zero if mode == "auto" else None,
            "status": st.get("autoscaling")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="fixed,auto,queue")
    args = ap.parse_args()
    c = local_cluster()
    ns = c.new_namespace("bench-trace")
    rows = []
    try:
        for mode in args.modes.split(","):
            rows.append(run_mode(c, ns, mode))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        c.kubectl("delete", "ns", ns, "--wait=false", check=False)
        if not c.reused:
            devcluster.stop()
    from prefix_routing import cpu_flags  # the benchmarks' one CPU description

    print("\n" + cpu_flags())
    print("trace: " + ", ".join(f"{p} {s}s ({a}->{b} clients)" for p, s, a, b in TRACE))
    print("\n| rule | replica-seconds | requests | TTFT p50 (s) | TTFT p90 (s) | failed | "
          "scale events | direction changes | first token from zero (s) |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        fz = f"{r['first_from_zero']:.1f}" if r["first_from_zero"] else "-"
        print(f"| {r['mode']} | {r['replica_s']} | {r['requests']} | {r['ttft_p50']:.2f} | "
              f"{r['ttft_p90']:.2f} | {r['failed']} | {r['scale_events']} | "
              f"{r['direction_changes']} | {fz} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
