"""Node health read from kopf's node index instead of a GET per node per pass, and the nodes
whose Ready condition just changed (their engines get a pass at once: node_loss.py decides).

The index holds each node's Ready condition only (`NodeHealth`), so a cluster of many nodes
costs a few strings per node. Nodes are cluster-scoped: kopf watches them cluster-wide even
when the operator watches only some namespaces (rbac.py: a ClusterRole rule).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping

from shoal.operator import labels as L
from shoal.operator.node_loss import NodeHealth

log = logging.getLogger("shoal.operator.nodes")

INDEX = "nodes_health"  # the handler's name: kopf passes the index under it

# node name -> its health, or None when the API does not have it
NodeSource = Callable[[str], NodeHealth | None]


def listed_node(kube) -> NodeSource:
    """A GET per node (what a pass does before a handler handed the index over)."""
    def source(name: str) -> NodeHealth | None:
        try:
            node = kube.get("v1", "nodes", None, name)
        except Exception as e:  # noqa: BLE001 - a node not read is a node not judged
            log.warning("could not read node %s: %s", name, e)
            return None
        return NodeHealth.of(node) if node is not None else None
    return source


class NodeIndex:
    """A `NodeSource` over kopf's index once a handler handed it over; a GET until then."""

    def __init__(self, fallback: NodeSource):
        self._index = None
        self._fallback = fallback

    def attach(self, index) -> None:
        self._index = index

    def __call__(self, name: str) -> NodeHealth | None:
        if self._index is None:
            return self._fallback(name)
        store = self._index.get(name)
        return next(iter(store), None) if store else None

    def health(self, names: Iterable[str]) -> dict[str, NodeHealth]:
        """The health of each named node the API has."""
        return {n: h for n in sorted(set(names)) if n and (h := self(n)) is not None}


class ReadyChanges:
    """Remembers each node's Ready status as last seen, so that a node event (a heartbeat every
    few seconds) wakes the engines on that node only when Ready changed."""

    def __init__(self) -> None:
        self._last: dict[str, str] = {}
        self._lock = threading.Lock()

    def changed(self, name: str, health: NodeHealth | None) -> bool:
        status = health.ready if health is not None else "Gone"
        with self._lock:
            before = self._last.get(name)
            if status == "Gone":
                self._last.pop(name, None)
            else:
                self._last[name] = status
        # a node first seen healthy changes nothing; one first seen unhealthy (an operator
        # that starts while a node is down) does
        return before != status and not (before is None and status == "True")


def engines_on(pods_index: Mapping | None, node: str) -> set[tuple[str, str]]:
    """(namespace, engine) of every engine pod of ours on this node, from the pod index."""
    out: set[tuple[str, str]] = set()
    if pods_index is None:
        return out
    for key in list(pods_index.keys()):
        namespace, engine, component = key
        if component != L.COMPONENT_ENGINE:
            continue
        if any((p.get("spec") or {}).get("nodeName") == node for p in list(pods_index[key])):
            out.add((namespace, engine))
    return out
