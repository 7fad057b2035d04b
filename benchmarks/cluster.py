"""The whole system on the local cluster (docs/cluster.md), measured: apply -> first token,
kill -9 of the EngineCore -> serving again (p50 over --kills), delete -> every child gone, and
the memory of the whole cluster at rest and under load. Prints a markdown table.

    sudo .venv/bin/python benchmarks/cluster.py [--kills 5] [--keep]

Uses a running cluster (make cluster) or starts one (and stops it at the end unless --keep).
Memory is the sum of PSS (/proc/PID/smaps_rollup) over every process of the cluster: control
plane, dnsmasq, each node's containerd/kubelet/kube-proxy and shims, and every container.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

from bench_cluster import local_cluster
from e2e.e2e_helpers import Stream, completes, create, service_url, status, wait_ready
from shoal.devcluster import clean
from shoal.devcluster import cluster as devcluster
from shoal.devcluster.node import CGROUP_FS
from support.cluster import Cluster
from support.wait import wait_for

KILL = ("import os, signal\n"
        "[os.kill(int(p), signal.SIGKILL) for p in os.listdir('/proc') if p.isdigit() and "
        "int(p) != os.getpid() and "
        "b'engine_core_proc' in open(f'/proc/{p}/cmdline', 'rb').read()]\n")


def pss_mib() -> dict[str, float]:
    """PSS by part of the cluster, MiB."""
    in_pods: set[int] = set()
    for node in ("shoal-node1", "shoal-node2"):
        cg = CGROUP_FS / "memory" / node / "kubepods"
        if cg.is_dir():
            in_pods |= clean.procs_in(cg)
    parts: dict[str, float] = {}
    for pid in clean.our_processes():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except OSError:
            continue
        kb = next((int(line.split()[1]) for line in rollup.splitlines()
                   if line.startswith("Pss:")), 0)
        name = Path(cmd).name
        part = ("pods (containers)" if pid in in_pods else
                "control plane" if name in ("etcd", "kube-apiserver", "kube-controller-manager",
                                            "kube-scheduler") else
                "node agents" if name in ("nsenter", "containerd", "kubelet", "kube-proxy",
                                          "containerd-shim-runc-v2") else name)
        parts[part] = parts.get(part, 0.0) + kb / 1024
    parts["total"] = sum(parts.values())
    return parts


def first_token_s(c: Cluster, ns: str, name: str) -> float:
    t0 = time.monotonic()
    create(c, ns, name)
    url = None

    def ok():
        nonlocal url
        try:
            url = url or service_url(c, ns, name)
        except AssertionError:
            return False
        return completes(url)

    wait_for(ok, timeout=600, interval=0.5, what="first token")
    return time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--keep", action="store_true", help="leave a cluster this run started up")
    args = ap.parse_args()
    rows: list[tuple[str, str]] = []
    t0 = time.monotonic()
    c = local_cluster()
    rows.append(("cluster start and operator install (this run)",
                 f"{time.monotonic() - t0:.0f} s" + (" (already running)" if c.reused else "")))
    ns = c.new_namespace("bench")
    try:
        mem = pss_mib()
        rows.append(("memory at rest, no engine (PSS)", f"{mem['total']:.0f} MiB ("
                     + ", ".join(f"{k} {v:.0f}" for k, v in mem.items() if k != "total") + ")"))
        a = first_token_s(c, ns, "bench-a")
        rows.append(("apply -> first token, first engine since cluster start", f"{a:.1f} s"))
        b = first_token_s(c, ns, "bench-b")
        rows.append(("apply -> first token, second engine (warm page cache)", f"{b:.1f} s"))
        mem = pss_mib()
        rows.append(("memory at rest, 2 engines + 2 frontends (PSS)", f"{mem['total']:.0f} MiB ("
                     + ", ".join(f"{k} {v:.0f}" for k, v in mem.items() if k != "total") + ")"))
        url = service_url(c, ns, "bench-a")
        streams = [Stream(url, max_tokens=400) for _ in range(8)]
        peak = {"total": 0.0}
        done = threading.Event()

        def sample():
            while not done.is_set():
                m = pss_mib()
                if m["total"] > peak["total"]:
                    peak.update(m)
                time.sleep(1)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        for s in streams:
            s.start()
        for s in streams:
            s.join(600)
        done.set()
        sampler.join()
        rows.append(("memory under load, peak (8 streams of 400 tokens) (PSS)",
                     f"{peak['total']:.0f} MiB (" + ", ".join(
                         f"{k} {v:.0f}" for k, v in peak.items() if k != "total") + ")"))
        kills = []
        for _ in range(args.kills):
            wait_ready(c, ns, "bench-a", "1/1")
            before = status(c, ns, "bench-a").get("restartCount", 0)
            c.kubectl("exec", "-n", ns, "bench-a-g0-r0", "-c", "engine", "--", "python3", "-c",
                      KILL)
            t = time.monotonic()
            wait_for(lambda b=before: status(c, ns, "bench-a").get("restartCount", 0) > b,
                     timeout=120, interval=0.2, what="restart recorded")
            wait_for(lambda: completes(url), timeout=600, interval=0.2, what="serving again")
            kills.append(time.monotonic() - t)
        rows.append((f"kill -9 EngineCore -> serving again, p50 of {len(kills)}",
                     f"{statistics.median(kills):.1f} s (all: "
                     + ", ".join(f"{k:.1f}" for k in kills) + ")"))
        t = time.monotonic()
        c.kubectl("delete", "ie", "bench-a", "bench-b", "-n", ns, "--wait=false")
        wait_for(lambda: not c.kubectl("get", "pods,deploy,svc,cm,pdb", "-n", ns, "-o", "name",
                                       "-l", "shoal.dev/engine").stdout.split(),
                 timeout=300, interval=0.5, what="every child gone")
        rows.append(("delete (2 engines, shutdown 10 s, idle) -> every child gone",
                     f"{time.monotonic() - t:.1f} s"))
    finally:
        c.kubectl("delete", "ns", ns, "--wait=false", check=False)
        if not c.reused and not args.keep:
            devcluster.stop()
    print("\n| measurement | value |\n|---|---|")
    for k, v in rows:
        print(f"| {k} | {v} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
