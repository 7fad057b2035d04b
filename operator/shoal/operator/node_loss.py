"""A lost node, decided from what the API says of it: pure, so a table tests every case.

Kubernetes marks a node that stops heartbeating `Ready=Unknown` after about 40 s, evicts its
pods only 5 minutes later, and an evicted pod then stays `Terminating` until the node's
kubelet confirms the stop, which a lost node never does. Until then the API still shows the
rank Running, and an engine group with a rank there is dead for minutes with nobody saying so.

Here: a node whose Ready condition has not been True for `restartPolicy.nodeLostSeconds` (from
its last transition) is lost. A live group with a rank on it dies with cause `node_lost` naming
the node and the rank (`node_lost`); every pod of ours on it is deleted with grace 0
(`on_lost_node`, used by every teardown), which is safe because an engine keeps no durable
state, and what the node's kubelet still runs is stopped by it when it returns (the pod object
it would run is gone). A node the API no longer has is left to Kubernetes (its pod GC removes
the pods at once, and a vanished rank is a death of its own).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass

from shoal.contract.termination import Cause
from shoal.operator.failures import Failure


@dataclass(frozen=True)
class NodeHealth:
    """A node's Ready condition: status (True, False, Unknown), since when, and the words of
    whoever set it (the kubelet, or the node controller: "Kubelet stopped posting node status")."""

    ready: str
    since: str | None = None
    reason: str = ""
    message: str = ""

    @classmethod
    def of(cls, node: Mapping) -> NodeHealth:
        conds = ((node.get("status") or {}).get("conditions")) or []
        ready = next((c for c in conds if c.get("type") == "Ready"), None)
        if ready is None:  # a node that never reported: not lost by anything we can tell
            return cls(ready="True")
        return cls(ready=str(ready.get("status") or "Unknown"),
                   since=ready.get("lastTransitionTime"),
                   reason=ready.get("reason") or "", message=ready.get("message") or "")

    @property
    def healthy(self) -> bool:
        return self.ready == "True"


def _parse(s: str | None) -> dt.datetime | None:
    if not s:
        return None
    return dt.datetime.strptime(s, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc)


def lost_at(health: NodeHealth | None, bound_seconds: int) -> dt.datetime | None:
    """When this node counts as lost (None: it is healthy, or unknown to us)."""
    if health is None or health.healthy:
        return None
    since = _parse(health.since)
    return None if since is None else since + dt.timedelta(seconds=bound_seconds)


def node_of(pod: Mapping) -> str:
    return (pod.get("spec") or {}).get("nodeName") or ""


def on_lost_node(nodes: Mapping[str, NodeHealth], bound_seconds: int, pod: Mapping,
                 now: dt.datetime) -> bool:
    """The pod is on a node lost by now: deleting it gracefully would wait forever."""
    at = lost_at(nodes.get(node_of(pod)), bound_seconds)
    return at is not None and now >= at


def node_lost(nodes: Mapping[str, NodeHealth], bound_seconds: int, group: int,
              pods: Mapping[int, Mapping], now: dt.datetime,
              ) -> tuple[Failure | None, float | None]:
    """The group's node-loss death (the rank whose node was lost first; then the lowest rank),
    and the seconds until the next node of this group would count as lost (None: none is due)."""
    lost, due = [], None
    for r, p in sorted(pods.items()):
        health = nodes.get(node_of(p))
        at = lost_at(health, bound_seconds)
        if at is None:
            continue
        if now < at:
            wait = (at - now).total_seconds()
            due = wait if due is None else min(due, wait)
            continue
        lost.append((at, r, p, health))
    if not lost:
        return None, due
    at, rank, pod, health = min(lost, key=lambda x: (x[0], x[1]))
    meta, node = pod["metadata"], node_of(pod)
    said = f": {health.reason}: {health.message}" if health.reason or health.message else ""
    return Failure(
        group=group,
        rank=rank,
        pod=meta["name"],
        # one death per pod and loss: a node that flaps gives a new transition time
        uid=f"nodelost-{meta.get('uid')}",
        node=node,
        exit_code=None,
        signal=None,
        reason="NodeLost",
        cause=Cause.NODE_LOST.value,
        permanent=False,
        message=(f"node {node} of rank {rank} has been Ready={health.ready} since "
                 f"{health.since}, past restartPolicy.nodeLostSeconds ({bound_seconds}s){said}; "
                 "its pods are removed (grace 0) and the group is recreated on other nodes"),
        time=health.since or "",
    ), None
