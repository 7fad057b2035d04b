"""How the operator copes with many InferenceEngines on a real API server.

    python benchmarks/operator_scale.py                      # 200 engines, 1 group x 2 ranks
    python benchmarks/operator_scale.py --engines 50 --groups 2 --ranks 2
    python benchmarks/operator_scale.py --kubeconfig PATH    # an already running control plane

Starts the project's test control plane (shoal.devcluster, built once into the cache)
unless --kubeconfig is given, installs the CRD, runs `python -m shoal.operator` as a child
process, creates the engines and reports:
- time until every child object exists (pods, Deployments, Services, ConfigMaps, PDBs);
- time until every engine reports phase Ready once the script, playing the kubelet, has marked
  every pod running and ready;
- the operator's API writes and reads (GET, LIST) per resource, counted by the operator itself
  (not kopf's watches), CPU seconds and peak resident memory;
- writes to the InferenceEngines themselves per lifecycle stage (create -> Ready, delete), seen
  by a watch: status patches, and metadata patches (kopf's progress annotations, finalizer);
  the operator cannot count kopf's own writes.

Engine pods are bound to a node, so their deletion is graceful as on a real one; the script's
kubelet lets rank 0 "drain" for --drain-seconds, reports its container terminated, then removes
the pod a second later (the pod object outlives the engine, as on a real node).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
from kubernetes import client
from shoal.devcluster.control_plane import ControlPlane
from shoal.operator import labels as L
from shoal.operator.kube import Kube
from support import crds
from support.kubelet import bind, finish_deletion, ready_frontends, set_ready, set_terminated
from support.net import free_port
from support.watch_log import WatchLog

REPO = Path(__file__).resolve().parents[1]


def _until(pred, timeout: float, what: str, interval: float = 0.25):
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


class Sampler(threading.Thread):
    """Samples the operator's RSS every 0.5 s; CPU comes from its cpu_times at the end."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.proc = psutil.Process(pid)
        self.peak_rss = 0
        self.stop = threading.Event()

    def run(self):
        while not self.stop.wait(0.5):
            try:
                self.peak_rss = max(self.peak_rss, self.proc.memory_info().rss)
            except psutil.Error:
                return

    def cpu_seconds(self) -> float:
        t = self.proc.cpu_times()
        return t.user + t.system


def _live(port: int) -> bool:
    import urllib.request

    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1).status == 200
    except OSError:
        return False


class Kubelet(threading.Thread):
    """Ends deleted engine pods as a node would: rank 0 after its drain, its container first."""

    def __init__(self, kube: Kube, ns: str, drain_s: float):
        super().__init__(daemon=True)
        self.kube, self.ns, self.drain_s = kube, ns, drain_s
        self.core = client.CoreV1Api(kube.api)
        self.stop = threading.Event()

    def run(self):
        seen: dict[str, float] = {}
        ended: dict[str, float] = {}
        sel = f"{L.LABEL_COMPONENT}={L.COMPONENT_ENGINE}"
        while not self.stop.wait(0.25):
            now = time.monotonic()
            for p in self.kube.list("v1", "pods", self.ns, sel):
                name = p["metadata"]["name"]
                if not p["metadata"].get("deletionTimestamp"):
                    continue
                start = seen.setdefault(name, now)
                rank0 = p["metadata"]["labels"].get(L.LABEL_RANK) == "0"
                if name not in ended and now - start >= (self.drain_s if rank0 else 0.0):
                    set_terminated(self.core, name, self.ns, exit_code=0)
                    ended[name] = now
                elif name in ended and now - ended[name] >= 1.0:
                    finish_deletion(self.core, name, self.ns)


def _engine(ns: str, i: int, groups: int, ranks: int) -> dict:
    return {
        "apiVersion": L.API_VERSION,
        "kind": L.KIND,
        "metadata": {"name": f"e{i:04d}", "namespace": ns},
        "spec": {
            "model": "/models/tiny",
            "replicas": groups,
            "nodesPerGroup": ranks,
            "tensorParallelSize": ranks,
        },
    }


def run(
    kubeconfig: str, n: int, groups: int, ranks: int, resync: float, workers: int, drain_s: float
) -> dict:
    from kubernetes import config

    kube = Kube(config.new_client_from_config(config_file=kubeconfig))
    crds.install(kube)
    ns = f"bench-{os.getpid()}"
    kube.request("POST", "/api/v1/namespaces", body={"metadata": {"name": ns}})
    stats = Path(tempfile.mkdtemp()) / "operator-stats.json"
    env = {
        **os.environ,
        "KUBECONFIG": kubeconfig,
        "SHOAL_RESYNC_SECONDS": str(resync),
        "SHOAL_OPERATOR_STATS_FILE": str(stats),
    }
    log = open(Path(stats.parent) / "operator.log", "w")
    port = free_port()
    op = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shoal.operator",
            "--namespace",
            ns,
            "--log-level",
            "warning",
            "--liveness",
            f"http://127.0.0.1:{port}/healthz",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
    )
    sampler = Sampler(op.pid)
    sampler.start()
    watcher = WatchLog.custom(
        config.new_client_from_config(config_file=kubeconfig), L.GROUP, L.VERSION, ns, L.PLURAL
    ).start()
    kubelet = Kubelet(kube, ns, drain_s)
    try:
        _until(
            lambda: _live(port), 60, "the operator's liveness endpoint"
        )  # start-up is not measured
        cpu0 = sampler.cpu_seconds()
        t0 = time.monotonic()
        url = f"/apis/{L.API_VERSION}/namespaces/{ns}/{L.PLURAL}"
        with cf.ThreadPoolExecutor(workers) as pool:
            list(
                pool.map(
                    lambda i: kube.request("POST", url, body=_engine(ns, i, groups, ranks)),
                    range(n),
                )
            )
        t_created = time.monotonic() - t0
        want_pods = n * groups * ranks
        engine_pods = f"{L.LABEL_COMPONENT}={L.COMPONENT_ENGINE}"

        def children_done():
            return (
                len(kube.list("v1", "pods", ns, engine_pods)) == want_pods
                and len(kube.list("apps/v1", "deployments", ns)) == n
                and len(kube.list("v1", "configmaps", ns, f"{L.LABEL_ENGINE}")) == n
                and len(kube.list("v1", "services", ns)) == 2 * n
            )

        _until(children_done, 600, "every child object", interval=0.5)
        t_children = time.monotonic() - t0

        t1 = time.monotonic()
        names = [p["metadata"]["name"] for p in kube.list("v1", "pods", ns, engine_pods)]

        core = client.CoreV1Api(kube.api)

        def start_pod(name):
            bind(core, name, ns, node="bench-node")  # deletion is graceful, as on a real node
            set_ready(core, name, ns)

        with cf.ThreadPoolExecutor(workers) as pool:
            list(pool.map(start_pod, names))
            _until(
                lambda: (
                    len(kube.list("v1", "pods", ns, f"{L.LABEL_COMPONENT}={L.COMPONENT_FRONTEND}"))
                    >= n
                ),
                600,
                "every frontend pod",
                interval=0.5,
            )
            list(pool.map(lambda i: ready_frontends(core, f"e{i:04d}", ns), range(n)))
        t_kubelet = time.monotonic() - t1

        def all_ready():
            items = kube.request("GET", url)["items"]
            return sum(1 for i in items if (i.get("status") or {}).get("phase") == "Ready") == n

        _until(all_ready, 600, "every engine Ready", interval=0.5)
        t_ready = time.monotonic() - t1

        # Delete every engine: the operator stops each group in rank order and then removes its
        # finalizer (pods are unscheduled here, so each stop completes at once).
        time.sleep(2)  # let the last Ready writes land in the create stage
        t_stage = time.monotonic()
        kubelet.start()
        t2 = time.monotonic()
        with cf.ThreadPoolExecutor(workers) as pool:
            list(
                pool.map(lambda i: kube.delete(L.API_VERSION, L.PLURAL, ns, f"e{i:04d}"), range(n))
            )
        _until(
            lambda: not kube.request("GET", url)["items"], 600, "every engine deleted", interval=0.5
        )
        t_deleted = time.monotonic() - t2
        cpu = sampler.cpu_seconds() - cpu0
        sampler.stop.set()
        kubelet.stop.set()
        watcher.stop()
        engine_writes: dict[str, int] = {}
        for i in range(n):
            for stage, since, until in (
                ("create", 0.0, t_stage),
                ("delete", t_stage, float("inf")),
            ):
                for what, c in watcher.writes(f"e{i:04d}", since, until).items():
                    engine_writes[f"{stage} {what}"] = engine_writes.get(f"{stage} {what}", 0) + c
    finally:
        op.terminate()
        try:
            op.wait(30)
        except subprocess.TimeoutExpired:
            op.kill()
        log.close()
    counts = json.loads(stats.read_text()) if stats.exists() else {}
    writes, reads = counts.get("writes", {}), counts.get("reads", {})
    kube.request("DELETE", f"/api/v1/namespaces/{ns}")
    return {
        "engines": n,
        "groups": groups,
        "ranks": ranks,
        "pods": want_pods,
        "resync": resync,
        "create_s": t_created,
        "children_s": t_children,
        "kubelet_s": t_kubelet,
        "ready_s": t_ready,
        "delete_s": t_deleted,
        "drain_s": drain_s,
        "engine_writes": dict(sorted(engine_writes.items())),
        "cpu_s": cpu,
        "peak_rss_mib": sampler.peak_rss / 2**20,
        "writes": writes,
        "reads": reads,
    }


def table(r: dict) -> str:
    rows = [
        (
            "engines x groups x ranks",
            f"{r['engines']} x {r['groups']} x {r['ranks']} ({r['pods']} pods)",
        ),
        ("resync interval", f"{r['resync']:g} s"),
        ("POST of all engines (client)", f"{r['create_s']:.1f} s"),
        ("all children created", f"{r['children_s']:.1f} s after the first POST"),
        ("kubelet: all pods marked ready", f"{r['kubelet_s']:.1f} s"),
        ("all engines Ready", f"{r['ready_s']:.1f} s after the first pod status patch"),
        (
            "all engines deleted (finalizers done)",
            f"{r['delete_s']:.1f} s after the first DELETE (rank 0 drains {r['drain_s']:g} s)",
        ),
        ("operator CPU (create..delete)", f"{r['cpu_s']:.1f} s"),
        ("operator peak RSS", f"{r['peak_rss_mib']:.0f} MiB"),
    ]
    total = sum(r["writes"].values())
    rows += [
        (f"writes: {k}", f"{v} ({v / r['engines']:.2f}/engine)")
        for k, v in sorted(r["writes"].items())
    ]
    rows.append(("writes: total", f"{total} ({total / r['engines']:.1f}/engine)"))
    reads = r.get("reads", {})
    rows += [
        (f"reads: {k}", f"{v} ({v / r['engines']:.2f}/engine)") for k, v in sorted(reads.items())
    ]
    calls = total + sum(reads.values())
    rows.append(
        ("API calls (reads + writes): total", f"{calls} ({calls / r['engines']:.1f}/engine)")
    )
    rows += [
        (f"InferenceEngine {k} writes", f"{v} ({v / r['engines']:.2f}/engine)")
        for k, v in r["engine_writes"].items()
    ]
    w = max(len(a) for a, _ in rows)
    return "\n".join(
        [f"| {'metric':<{w}} | value |", f"|{'-' * (w + 2)}|-------|"]
        + [f"| {a:<{w}} | {b} |" for a, b in rows]
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=200)
    ap.add_argument("--groups", type=int, default=1)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument(
        "--resync", type=float, default=10.0, help="operator timer interval (SHOAL_RESYNC_SECONDS)"
    )
    ap.add_argument(
        "--workers", type=int, default=8, help="client threads for creates and status patches"
    )
    ap.add_argument(
        "--drain-seconds", type=float, default=5.0, help="how long rank 0 drains on delete"
    )
    ap.add_argument("--kubeconfig", help="use this running control plane instead of starting one")
    ap.add_argument("--json", action="store_true", help="print the raw result as JSON too")
    args = ap.parse_args(argv)
    sizes = (args.engines, args.groups, args.ranks, args.resync, args.workers, args.drain_seconds)
    if args.kubeconfig:
        result = run(args.kubeconfig, *sizes)
    else:
        with tempfile.TemporaryDirectory(prefix="shoal-bench-") as root:
            cp = ControlPlane(Path(root))
            cp.start(timeout=180)
            try:
                result = run(str(cp.kubeconfig), *sizes)
            finally:
                cp.stop()
    print(table(result))
    if args.json:
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
