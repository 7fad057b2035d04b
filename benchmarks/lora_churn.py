"""Adapter churn on the local cluster (docs/cluster.md): one InferenceEngine with `spec.lora`
and a pool of adapters made with the real `peft`, while client threads send completions for
the adapters that exist through the frontend Service. A driver runs N operations, chosen at
random: load (create an InferenceAdapter), unload (delete one), scale up or down
(`spec.replicas` 1..3), kill a group (SIGKILL its EngineCore); a scale or a kill only while
every group is Ready (else that step is skipped), one every 0.5-1.5 s. Prints a markdown table:

- requests sent to a group without their adapter: the engine's own 404 ("Served models: ...")
  as the client saw it, and those the frontend re-sent to another group after one
  (`shoal_router_adapter_misses_total`); a request the router answers itself names
  "Available models" instead;
- adapters reported Ready while a request for them failed with a 404 (Ready at send and at
  answer);
- every other failed request, by cause (a killed group's requests in flight fail; that is the
  kill, not an adapter);
- apply -> Ready of the loads (from the adapters' status, sampled every 0.5 s);

and, before the table, each burst of the first two (none 3 s apart) with the operations of the
10 s before it and its first answer: where to look when they are not 0.

The driver stops sending requests for an adapter before it deletes it (a user deleting an
adapter has stopped using it); every other race is left in.

    sudo PYTHONPATH=tests .venv/bin/python benchmarks/lora_churn.py [--ops 1000]
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.engine.lora_peft
from bench_cluster import local_cluster  # noqa: E402
from e2e.e2e_helpers import create, kill9_engine_core, pods, service_url, wait_ready  # noqa: E402
from shoal.devcluster import cluster as devcluster  # noqa: E402
from shoal.devcluster.layout import MODEL_HOST_DIR  # noqa: E402
from shoal.operator import labels as L  # noqa: E402
from shoal.operator.kube import Kube  # noqa: E402
from support.cluster import MODEL_MOUNT  # noqa: E402

from tests.engine import lora_peft  # noqa: E402

NAME = "churn"
POOL = 6  # adapters that come and go
CLIENTS = 4
WEIGHTS = {"load": 40, "unload": 40, "scale": 15, "kill": 5}


class Adapters:
    """The driver's view: which adapters exist (and may be asked for), requests in flight per
    adapter, and each adapter's phase as last listed."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.live: set[str] = set()
        self.in_flight: collections.Counter = collections.Counter()
        self.phase: dict[str, str] = {}
        self.applied: dict[str, float] = {}
        self.to_ready: list[float] = []

    def pick(self, rng: random.Random) -> str | None:
        with self.lock:
            if not self.live:
                return None
            name = rng.choice(sorted(self.live))
            self.in_flight[name] += 1
            return name

    def done(self, name: str) -> None:
        with self.lock:
            self.in_flight[name] -= 1


class Counts:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ok = 0
        self.without_adapter: list[str] = []
        self.ready_but_404: list[str] = []
        self.other: collections.Counter = collections.Counter()
        self.log: list[tuple[float, str, str]] = []  # (when, kind, detail) of the two goals

    def add(self, kind: str, detail: str = "") -> None:
        with self.lock:
            if kind in ("without", "ready404"):
                self.log.append((time.monotonic(), kind, detail))
            if kind == "ok":
                self.ok += 1
            elif kind == "without":
                self.without_adapter.append(detail)
            elif kind == "ready404":
                self.ready_but_404.append(detail)
            else:
                self.other[detail[:80]] += 1


def client(url: str, ads: Adapters, counts: Counts, stop: threading.Event, seed: int) -> None:
    rng = random.Random(seed)
    with httpx.Client(timeout=60) as http:
        while not stop.is_set():
            name = ads.pick(rng)
            if name is None:
                time.sleep(0.1)
                continue
            before = ads.phase.get(name)
            try:
                r = http.post(f"{url}/completions", json={"model": name, "prompt": "SELECT",
                                                          "max_tokens": 4})
                text, code = r.text, r.status_code
            except httpx.HTTPError as e:
                text, code = f"{type(e).__name__}", 0
            finally:
                ads.done(name)
            if code == 200:
                counts.add("ok")
            elif code == 404 and "Served models" in text:
                counts.add("without", f"{name}: {text[:160]}")
            elif code == 404 and before == "Ready" and ads.phase.get(name) == "Ready":
                counts.add("ready404", f"{name}: {text[:160]}")
            elif code == 404:
                counts.add("other", "404 before the adapter was Ready (the router's own answer)")
            else:
                counts.add("other", f"{code} {text[:60]}")


def watch(kube: Kube, ns: str, ads: Adapters, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            items = kube.list(L.API_VERSION, L.ADAPTER_PLURAL, ns)
        except Exception:  # noqa: BLE001 - the next look
            time.sleep(0.5)
            continue
        now = time.monotonic()
        with ads.lock:
            ads.phase = {a["metadata"]["name"]: (a.get("status") or {}).get("phase", "")
                         for a in items}
            for name, phase in ads.phase.items():
                if phase == "Ready" and name in ads.applied:
                    ads.to_ready.append(now - ads.applied.pop(name))
        time.sleep(0.5)


def _settled(kube: Kube, ns: str, replicas: int) -> bool:
    st = (kube.get(L.API_VERSION, L.PLURAL, ns, NAME) or {}).get("status") or {}
    return st.get("phase") == "Ready" and st.get("ready") == f"{replicas}/{replicas}"


def _router_misses(url: str) -> float:
    """The frontend's count of adapter requests a group answered 404 for (re-sent to another
    group): sends to a group without the adapter that the client never saw."""
    try:
        text = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=10).text
    except httpx.HTTPError as e:  # a count that could not be read is not the run's end
        print(f"[churn] could not read the routers' miss counter: {type(e).__name__}: {e}")
        return float("nan")
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("shoal_router_adapter_misses_total"))


def bursts(log: list, oplog: list, t0: float) -> None:
    """Each burst of goal failures (none 3 s apart) with the operations of the 10 s before
    its start: what to read first when the counts are not 0."""
    runs: list[list] = []
    for at, kind, detail in sorted(log):
        if runs and at - runs[-1][-1][0] <= 3:
            runs[-1].append((at, kind, detail))
        else:
            runs.append([(at, kind, detail)])
    for burst in runs:
        start, end = burst[0][0], burst[-1][0]
        kinds = collections.Counter(k for _, k, _ in burst)
        before = [f"{at - t0:.1f} {what}" for at, what in oplog if start - 10 <= at <= end]
        print(f"[burst +{start - t0:.1f}s..+{end - t0:.1f}s] {dict(kinds)}; ops: "
              f"{'; '.join(before) or '-'}; first: {burst[0][2][:300]}", flush=True)


def run(c, ns: str, root: str, ops: int, seed: int) -> dict:
    kube = Kube(c.api_client())
    rng = random.Random(seed)
    ads, counts, stop = Adapters(), Counts(), threading.Event()
    url = service_url(c, ns, NAME)
    threads = [threading.Thread(target=client, args=(url, ads, counts, stop, seed + i),
                                daemon=True) for i in range(CLIENTS)]
    threads.append(threading.Thread(target=watch, args=(kube, ns, ads, stop), daemon=True))
    for t in threads:
        t.start()
    done: collections.Counter = collections.Counter()
    oplog: list[tuple[float, str]] = []  # (when, what) of each operation, for the bursts
    replicas = 2
    t0 = time.monotonic()
    for i in range(ops):
        op = rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()))[0]
        present = set(ads.phase) | ads.live
        if op == "load":
            free = [f"a{k}" for k in range(POOL) if f"a{k}" not in present]
            if not free:
                op = "unload"
            else:
                name = rng.choice(free)
                kube.request("POST", f"/apis/{L.API_VERSION}/namespaces/{ns}/"
                             f"{L.ADAPTER_PLURAL}",
                             body={"apiVersion": L.API_VERSION, "kind": L.ADAPTER_KIND,
                                   "metadata": {"name": name, "namespace": ns},
                                   "spec": {"engine": NAME, "source": f"{root}/{name}"}})
                with ads.lock:
                    ads.live.add(name)
                    ads.applied[name] = time.monotonic()
                oplog.append((time.monotonic(), f"load {name}"))
        if op == "unload":
            if not ads.live:
                continue
            name = rng.choice(sorted(ads.live))
            with ads.lock:
                ads.live.discard(name)
                ads.applied.pop(name, None)
            while ads.in_flight[name]:  # its user stopped asking for it first
                time.sleep(0.05)
            kube.delete(L.API_VERSION, L.ADAPTER_PLURAL, ns, name)
            oplog.append((time.monotonic(), f"unload {name}"))
        elif op in ("scale", "kill") and not _settled(kube, ns, replicas):
            op = "skipped"  # one disruption at a time: the engine first serves what it has
        elif op == "scale":
            replicas = max(1, min(3, replicas + rng.choice((-1, 1))))
            kube.patch(L.API_VERSION, L.PLURAL, ns, NAME, {"spec": {"replicas": replicas}})
            oplog.append((time.monotonic(), f"scale to {replicas}"))
        elif op == "kill":
            ranks = [p for p in pods(c, ns, "shoal.dev/component=engine,shoal.dev/rank=0")
                     if p["status"].get("phase") == "Running"]
            if ranks:
                victim = rng.choice(ranks)["metadata"]["name"]
                oplog.append((time.monotonic(), f"kill {victim}"))
                try:
                    kill9_engine_core(c, ns, victim)
                except Exception:  # noqa: BLE001 - it was stopping anyway
                    pass
        done[op] += 1
        if (i + 1) % 100 == 0:
            print(f"[churn +{time.monotonic() - t0:5.0f}s] {i + 1}/{ops} operations; "
                  f"{counts.ok} ok, {len(counts.without_adapter)} without adapter, "
                  f"{len(counts.ready_but_404)} Ready-but-404, {sum(counts.other.values())} "
                  "other failures", flush=True)
        time.sleep(rng.uniform(0.5, 1.5))
    stop.set()
    for t in threads:
        t.join(timeout=90)
    misses = _router_misses(url)
    bursts(counts.log, oplog, t0)
    return {"ops": dict(done), "seconds": round(time.monotonic() - t0), "ok": counts.ok,
            "router_misses": misses,
            "without_adapter": counts.without_adapter, "ready_but_404": counts.ready_but_404,
            "other": dict(counts.other), "to_ready": ads.to_ready}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    c = local_cluster()
    made = MODEL_HOST_DIR / "adapters-churn"
    base = str(MODEL_HOST_DIR / "shoal-tiny")
    for k in range(POOL):
        if not (made / f"a{k}" / "adapter_model.safetensors").is_file():
            lora_peft.make_adapter(base, made / f"a{k}", 60 + k, r=8)
        for f in (made / f"a{k}").iterdir():
            f.chmod(0o644)  # the engine runs as uid 10001
    ns = c.new_namespace("bench-churn")
    try:
        create(c, ns, NAME, replicas=2, lora={"maxLoras": 4}, backoff_base=1)
        wait_ready(c, ns, NAME, "2/2")
        r = run(c, ns, f"{MODEL_MOUNT}/{made.name}", args.ops, args.seed)
    finally:
        c.kubectl("delete", "ns", ns, "--wait=false", check=False)
        if not c.reused:
            devcluster.stop()
        shutil.rmtree(made, ignore_errors=True)
    print(json.dumps({k: v for k, v in r.items() if k != "to_ready"}, indent=1))
    from prefix_routing import cpu_flags  # the benchmarks' one CPU description

    print("\n" + cpu_flags())
    ops = ", ".join(f"{n} {k}" for k, n in sorted(r["ops"].items()))
    ready = sorted(r["to_ready"])
    p50 = f"{statistics.median(ready):.1f}" if ready else "-"
    p90 = f"{ready[int(0.9 * (len(ready) - 1))]:.1f}" if ready else "-"
    print(f"\n{sum(r['ops'].values())} operations in {r['seconds']} s ({ops}); "
          f"{CLIENTS} clients\n")
    print("| requests ok | a group's 404 seen by the client | sent to a group without it, "
          "re-sent by the router | Ready while a request 404s | other failures | "
          "load -> Ready p50 (s) | p90 (s) |\n|---|---|---|---|---|---|---|")
    print(f"| {r['ok']} | {len(r['without_adapter'])} | {r['router_misses']:.0f} | "
          f"{len(r['ready_but_404'])} | {sum(r['other'].values())} | {p50} | {p90} |")
    for cause, n in sorted(r["other"].items(), key=lambda kv: -kv[1]):
        print(f"- other: {n} x {cause}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
