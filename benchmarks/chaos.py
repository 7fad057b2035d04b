"""Chaos on the local cluster (docs/cluster.md): one InferenceEngine (2 groups, 2 frontends)
serving 16 streaming clients through its Service while a driver injects one fault at a time,
chosen at random, 25-40 s after the cluster recovered from the last one:

- `core`: SIGKILL the EngineCore inside a group's rank 0;
- `api`: SIGKILL the API-server process (`shoal serve`) inside a group's rank 0;
- `engine_pod`: force-delete a rank 0 pod (grace 0);
- `frontend_pod`: delete a frontend pod;
- `operator_pod`: delete the operator pod;
- `node`: freeze the node without the operator (`python -m shoal.devcluster freeze`: its
  kubelet, runtime and containers stop, as a lost machine's do) until the engine is whole on
  the other node, then thaw it.

Recovered = every group Ready, both frontends ready and a completion through the Service
answering; the recovery time of a fault is from its injection to that. A stream is
`finished` (its finish_reason came), `failed` (an error event or a dropped connection), or
`hung` (no chunk for 120 s). A failed stream counts "near a fault" when it was in flight at
any moment between a fault's injection and 10 s after that fault's recovery, else "away from
any fault". After the run: each group's rank 0 must show 0 running, 0 waiting and an empty KV
cache, and after the InferenceEngine is deleted no pod of it may be left.

    sudo PYTHONPATH=tests .venv/bin/python benchmarks/chaos.py [--minutes 10] [--seed 1]

Goals (issue 29): 0 hung, 0 failures away from a fault, every group back, nothing left over.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

import httpx
from bench_cluster import local_cluster
from e2e.e2e_helpers import create, kill9_engine_core, pods, service_url, status, wait_ready
from shoal.devcluster import cluster as devcluster
from support.wait import wait_for

NAME = "chaos"
CLIENTS = 16
KINDS = ("core", "api", "engine_pod", "frontend_pod", "operator_pod", "node")
OPERATOR = "app.kubernetes.io/component=operator"
HANG_SECONDS = 120.0
NEAR_SECONDS = 10.0
KILL_API = ("import os, signal\n"
            "me = os.getpid()\n"
            "def cmd(p):\n"
            "    return open(f'/proc/{p}/cmdline', 'rb').read().split(b'\\0')\n"
            "pids = [int(p) for p in os.listdir('/proc') if p.isdigit() and int(p) not in (1, me)"
            " and b'serve' in cmd(p) and not any(b'engine_core' in a for a in cmd(p))]\n"
            "assert pids, 'no API-server process'\n"
            "os.kill(min(pids), signal.SIGKILL)\nprint(min(pids))\n")


class Streams:
    """Every stream's (start, end, outcome); outcome: finished | failed:WHY | hung."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rows: list[tuple[float, float, str]] = []

    def add(self, start: float, outcome: str) -> None:
        with self.lock:
            self.rows.append((start, time.monotonic(), outcome))


def client(url: str, streams: Streams, stop: threading.Event, seed: int) -> None:
    rng = random.Random(seed)
    body = {"model": "shoal-tiny", "max_tokens": 48, "stream": True, "ignore_eos": True}
    timeout = httpx.Timeout(HANG_SECONDS, connect=10.0)
    with httpx.Client(timeout=timeout) as http:
        while not stop.is_set():
            start, outcome = time.monotonic(), "failed:no finish_reason"
            try:
                with http.stream("POST", f"{url}/completions",
                                 json={**body, "prompt": f"story {rng.random()}"}) as r:
                    if r.status_code != 200:
                        outcome = f"failed:HTTP {r.status_code}"
                    else:
                        for line in r.iter_lines():
                            if line.startswith("data: {") and '"error"' in line:
                                outcome = "failed:error event"
                            elif '"finish_reason":"length"' in line.replace(" ", ""):
                                outcome = "finished"
            except httpx.ReadTimeout:
                outcome = "hung"
            except httpx.HTTPError as e:
                outcome = f"failed:{type(e).__name__}"
            streams.add(start, outcome)
            if outcome != "finished":
                stop.wait(0.5)


def _rank0s(c, ns: str) -> list[dict]:
    return [p for p in pods(c, ns, f"shoal.dev/engine={NAME},shoal.dev/rank=0")
            if not p["metadata"].get("deletionTimestamp") and p["status"].get("podIP")]


def _completes(url: str) -> bool:
    try:
        r = httpx.post(f"{url}/completions", json={"model": "shoal-tiny", "prompt": "hi",
                                                   "max_tokens": 2}, timeout=20)
        return r.status_code == 200
    except httpx.HTTPError:
        return False


def recovered(c, ns: str, url: str) -> bool:
    st = status(c, ns, NAME)
    fes = [p for p in pods(c, ns, f"shoal.dev/engine={NAME},shoal.dev/component=frontend")
           if not p["metadata"].get("deletionTimestamp")
           and any(x.get("ready") for x in p["status"].get("containerStatuses") or [])]
    return st.get("ready") == "2/2" and len(fes) == 2 and _completes(url)


def node_of(c, ns: str, sel: str) -> set[str]:
    return {p["spec"].get("nodeName") for p in pods(c, ns, sel)}


def _uids(c, ns: str, sel: str) -> set[str]:
    return {p["metadata"]["uid"] for p in pods(c, ns, sel)
            if not p["metadata"].get("deletionTimestamp")}


def inject(c, ns: str, kind: str, rng: random.Random) -> tuple[str, callable, callable]:
    """Inject one fault; returns what it hit, when the system has noticed it (a recovery is
    judged only after that), and what to do once the engine is whole again."""
    def nothing():
        return None
    restarts = status(c, ns, NAME).get("restartCount", 0)

    def restarted():
        return status(c, ns, NAME).get("restartCount", 0) > restarts
    if kind in ("core", "api", "engine_pod"):
        victim = rng.choice(_rank0s(c, ns))
        target, uid = victim["metadata"]["name"], victim["metadata"]["uid"]

        def replaced_or_restarted():  # a one-rank group that vanished is recreated silently
            return restarted() or all(p["metadata"]["uid"] != uid for p in pods(
                c, ns, f"shoal.dev/engine={NAME}") if p["metadata"]["name"] == target)
        if kind == "core":
            kill9_engine_core(c, ns, target)
        elif kind == "api":
            c.kubectl("exec", "-n", ns, target, "-c", "engine", "--", "python3", "-c", KILL_API)
        else:
            c.kubectl("delete", "pod", "-n", ns, target, "--grace-period=0", "--force",
                      "--wait=false")
        return target, replaced_or_restarted, nothing
    if kind in ("frontend_pod", "operator_pod"):
        where, sel = ((ns, f"shoal.dev/engine={NAME},shoal.dev/component=frontend")
                      if kind == "frontend_pod" else ("shoal-system", OPERATOR))
        before = _uids(c, where, sel)
        target = rng.choice([p for p in pods(c, where, sel)
                             if not p["metadata"].get("deletionTimestamp")])
        c.kubectl("delete", "pod", "-n", where, target["metadata"]["name"], "--wait=false")

        def replaced():  # a new pod of the kind is Ready
            return any(p["metadata"]["uid"] not in before and any(
                x.get("ready") for x in p["status"].get("containerStatuses") or [])
                for p in pods(c, where, sel))
        return target["metadata"]["name"], replaced, nothing
    op_nodes = node_of(c, "shoal-system", OPERATOR)
    nodes = [n["metadata"]["name"] for n in c.get("nodes")["items"]]
    target = next(n for n in nodes if n not in op_nodes)
    engines_there = bool(node_of(c, ns, f"shoal.dev/engine={NAME}") & {target})
    subprocess.run([sys.executable, "-m", "shoal.devcluster", "freeze", target], check=True,
                   capture_output=True, timeout=60)

    def lost():  # the node controller marked it, and its groups (if any) died node_lost
        node = c.get("node", target)
        down = any(x["type"] == "Ready" and x["status"] != "True"
                   for x in node["status"]["conditions"])
        return down and (restarted() or not engines_there)

    def thaw():
        subprocess.run([sys.executable, "-m", "shoal.devcluster", "thaw", target], check=True,
                       capture_output=True, timeout=60)
        wait_for(lambda: any(x["type"] == "Ready" and x["status"] == "True"
                             for x in c.get("node", target)["status"]["conditions"]),
                 timeout=180, what=f"{target} Ready again")
    return target, lost, thaw


def engine_idle(ip: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{ip}:8000/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for metric in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                   "vllm:kv_cache_usage_perc"):
        m = re.search(rf"^{re.escape(metric)}(?:\{{[^}}]*\}})? ([0-9.e+-]+)$", text, re.M)
        out[metric] = float(m.group(1)) if m else float("nan")
    return out


def run(c, ns: str, minutes: float, seed: int) -> dict:
    rng = random.Random(seed)
    url = service_url(c, ns, NAME)
    wait_for(lambda: recovered(c, ns, url), timeout=300, what="serving before the chaos")
    streams, stop = Streams(), threading.Event()
    workers = [threading.Thread(target=client, args=(url, streams, stop, seed * 100 + i),
                                daemon=True) for i in range(CLIENTS)]
    for w in workers:
        w.start()
    faults: list[dict] = []
    t_end = time.monotonic() + minutes * 60
    try:
        while time.monotonic() < t_end:
            time.sleep(rng.uniform(25, 40))
            if time.monotonic() >= t_end:
                break
            kind = rng.choice(KINDS)
            t0 = time.monotonic()
            target, noticed, after = inject(c, ns, kind, rng)
            print(f"[chaos +{t0 - (t_end - minutes * 60):5.0f}s] {kind}: {target}", flush=True)
            wait_for(noticed, timeout=300, interval=0.5, what=f"{kind} ({target}) noticed")
            wait_for(lambda: recovered(c, ns, url), timeout=600, interval=1,
                     what=f"recovery from {kind} ({target})")
            t1 = time.monotonic()
            after()
            if kind == "node":  # the thawed node must not bring back a second copy
                wait_for(lambda: recovered(c, ns, url), timeout=300, interval=1,
                         what="still whole after the thaw")
            faults.append({"kind": kind, "target": target, "start": t0, "recovered": t1,
                           "end": time.monotonic()})
            print(f"[chaos] {kind} recovered in {t1 - t0:.1f}s", flush=True)
    finally:
        stop.set()
        for w in workers:
            w.join(HANG_SECONDS + 30)
    return {"streams": list(streams.rows), "faults": faults}


def near(row: tuple[float, float, str], faults: list[dict]) -> bool:
    start, end, _ = row
    return any(start <= f["end"] + NEAR_SECONDS and end >= f["start"] for f in faults)


def report(r: dict, idle: list[dict], left: list[str], restarts: int) -> None:
    rows, faults = r["streams"], r["faults"]
    outcome = collections.Counter(
        "finished" if o == "finished" else "hung" if o == "hung"
        else "failed near a fault" if near((s, e, o), faults) else "failed away from any fault"
        for s, e, o in rows)
    why = collections.Counter(o for s, e, o in rows if o.startswith("failed"))
    span = (max((f["end"] for f in faults), default=0)
            - min((f["start"] for f in faults), default=0)) / 60
    print(f"\n{len(faults)} faults over {span:.1f} min; {CLIENTS} streaming clients; "
          f"restartCount {restarts}\n")
    print("| streams | finished | failed near a fault | failed away from any fault | hung |")
    print("|---|---|---|---|---|")
    print(f"| {len(rows)} | {outcome['finished']} | {outcome['failed near a fault']} | "
          f"{outcome['failed away from any fault']} | {outcome['hung']} |")
    for w, n in why.most_common():
        print(f"- {n} x {w.split(':', 1)[1]}")
    print("\n| fault | count | recovery p50 (s) | max (s) |\n|---|---|---|---|")
    by = collections.defaultdict(list)
    for f in faults:
        by[f["kind"]].append(f["recovered"] - f["start"])
    for kind in KINDS:
        xs = by.get(kind)
        if xs:
            print(f"| {kind} | {len(xs)} | {statistics.median(xs):.1f} | {max(xs):.1f} |")
    print("\nafter the run (each group's rank 0):")
    for g in idle:
        print(f"- {json.dumps(g)}")
    print(f"pods left after the delete: {left or 'none'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    c = local_cluster()
    ns = c.new_namespace("bench-chaos")
    try:
        create(c, ns, NAME, replicas=2, backoff_base=1,
               frontend={"replicas": 2, "resources": {"requests": {"cpu": "50m",
                                                                    "memory": "64Mi"}}})
        wait_ready(c, ns, NAME, "2/2")
        r = run(c, ns, args.minutes, args.seed)
        url = service_url(c, ns, NAME)
        wait_for(lambda: recovered(c, ns, url), timeout=600, what="whole after the run")

        def idle_now() -> list[dict] | None:
            got = [{"pod": p["metadata"]["name"], **engine_idle(p["status"]["podIP"])}
                   for p in _rank0s(c, ns)]
            return got if all(v == 0 for g in got for k, v in g.items() if k != "pod") else None
        try:
            idle = wait_for(idle_now, timeout=60, what="every engine idle")
        except Exception:  # noqa: BLE001 - reported as it is
            idle = [{"pod": p["metadata"]["name"], **engine_idle(p["status"]["podIP"])}
                    for p in _rank0s(c, ns)]
        restarts = status(c, ns, NAME).get("restartCount", 0)
        c.kubectl("delete", "ie", NAME, "-n", ns, "--wait=false")
        try:
            wait_for(lambda: not pods(c, ns, f"shoal.dev/engine={NAME}"), timeout=180,
                     what="every pod of the engine gone")
        except Exception:  # noqa: BLE001 - reported as it is
            pass
        left = [p["metadata"]["name"] for p in pods(c, ns, f"shoal.dev/engine={NAME}")]
    finally:
        c.kubectl("delete", "ns", ns, "--wait=false", check=False)
        if not c.reused:
            devcluster.stop()
    from prefix_routing import cpu_flags  # the benchmarks' one CPU description

    print("\n" + cpu_flags())
    report(r, idle, left, restarts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
