"""Freeze a node the way a node is lost, and resume it: for the node-loss tests and the chaos
benchmark (`python -m shoal.devcluster freeze NODE` / `thaw NODE`).

A lost machine stops answering without anybody telling the API server: its kubelet posts no
more status, its containers neither run nor exit. Here: every process of the node's own
(containerd, its shims, kubelet, kube-proxy: the processes in the node's network namespace)
gets SIGSTOP, and its containers (the node's cgroup root, kubelet `--cgroup-root=/NODE`) are
frozen with the v1 freezer. Nothing is killed: `thaw` resumes all of it, and the node's kubelet
then finds out what the API decided while it was gone.

The host reaches Service IPs through one node's kube-proxy (shoal.devcluster.net); while that
node is frozen the route moves to a running node, and back on thaw. Without it a frozen node 1
would cut the test host off every Service, which says nothing about the cluster: clients of a
real cluster do not all enter it through one machine.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from shoal.devcluster import net
from shoal.devcluster.layout import NodeLayout, nodes
from shoal.devcluster.node import CGROUP_FS
from shoal.devcluster.procs import DevClusterError, log


def node_named(name: str) -> NodeLayout:
    for n in nodes():
        if n.name == name:
            return n
    raise DevClusterError(f"no node {name!r}: the nodes are {', '.join(n.name for n in nodes())}")


def daemons(n: NodeLayout) -> list[int]:
    """The node's own processes: those in its network namespace (pods have their own)."""
    try:
        want = os.stat(n.netns).st_ino
    except OSError as e:
        raise DevClusterError(f"{n.name}: no network namespace at {n.netns}: {e}") from e
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.stat(entry / "ns" / "net").st_ino == want:
                pids.append(int(entry.name))
        except OSError:
            continue
    return sorted(pids)


def freezer(n: NodeLayout) -> Path:
    return CGROUP_FS / "freezer" / n.name / "freezer.state"


def frozen(n: NodeLayout) -> bool:
    try:
        return freezer(n).read_text().strip() != "THAWED"
    except OSError:
        return False


def _route_services() -> None:
    """The host's Service route through the first node that is not frozen (node 1 when none)."""
    running = [n for n in nodes() if not frozen(n)]
    if running:
        net.route_services(running[0])


def _signal(pids: list[int], sig: signal.Signals) -> int:
    done = 0
    for pid in pids:
        try:
            os.kill(pid, sig)
            done += 1
        except ProcessLookupError:
            pass
    return done


def freeze(name: str) -> dict:
    """Stop the node's containers, then its daemons; returns what was stopped."""
    n = node_named(name)
    state = freezer(n)
    state.write_text("FROZEN")
    pids = daemons(n)
    stopped = _signal(pids, signal.SIGSTOP)
    log(f"{name}: frozen (containers: {state}; {stopped} node processes stopped: SIGSTOP)")
    _route_services()
    return {"node": name, "processes": pids, "cgroup": str(state)}


def thaw(name: str) -> dict:
    """Resume the node's daemons and its containers (idempotent)."""
    n = node_named(name)
    pids = daemons(n)
    resumed = _signal(pids, signal.SIGCONT)
    state = freezer(n)
    if state.exists():
        state.write_text("THAWED")
    log(f"{name}: thawed ({resumed} node processes resumed: SIGCONT)")
    _route_services()
    return {"node": name, "processes": pids}


def thaw_all() -> None:
    """Before a teardown: frozen processes would not die in time (SIGKILL waits for a thaw)."""
    for n in nodes():
        if n.netns.exists() or freezer(n).exists():
            try:
                thaw(n.name)
            except (DevClusterError, OSError):
                pass
