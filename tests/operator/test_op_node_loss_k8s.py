"""Node loss with the real operator on a real API server: Node objects whose Ready condition is
written here as the node controller writes it, ranks bound to them as the scheduler binds them
(support/kubelet.py plays the kubelet). The pure decisions are table-tested in test_op_plan.py;
here the watch on nodes, the wake-up at the bound and the grace-0 delete meet a real server."""

from __future__ import annotations

import datetime as dt
import time
import uuid

import pytest
from kubernetes import client
from shoal.operator import labels as L
from support import kubelet
from support.builders import engine
from support.engine_api import create_ie, events, ie, pods
from support.wait import wait_for


def _stamp(seconds_ago: float) -> str:
    t = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=seconds_ago)
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def _set_ready(core: client.CoreV1Api, node: str, status: str, seconds_ago: float = 0) -> None:
    """The Ready condition as the node controller writes it for a node gone quiet."""
    reason = {"True": "KubeletReady", "Unknown": "NodeStatusUnknown"}[status]
    cond = {"type": "Ready", "status": status, "reason": reason,
            "message": "Kubelet stopped posting node status." if status != "True" else "ok",
            "lastHeartbeatTime": _stamp(seconds_ago), "lastTransitionTime": _stamp(seconds_ago)}
    core.patch_node_status(node, {"status": {"conditions": [cond]}})


@pytest.fixture
def nodes(core):
    """Two Node objects of this test's own (cluster-scoped names), Ready; deleted at the end."""
    names = [f"shoal-node-{uuid.uuid4().hex[:6]}-{i}" for i in range(2)]
    for n in names:
        core.create_node({"apiVersion": "v1", "kind": "Node", "metadata": {"name": n}})
        _set_ready(core, n, "True")
    yield names
    for n in names:
        core.delete_node(n)


def _status(kube, ns: str, name: str) -> dict:
    return (ie(kube, ns, name) or {}).get("status") or {}


def _group0(kube, ns: str, name: str) -> str:
    groups = _status(kube, ns, name).get("groups") or [{}]
    return groups[0].get("phase") or ""


def test_a_rank_on_a_node_lost_past_the_bound_restarts_its_group_once(ns, kube, core, nodes):
    a, b = nodes
    create_ie(kube, engine("nl", ns).ranks(2).restart(backoffBaseSeconds=1).manifest())
    wait_for(lambda: len(pods(kube, ns, "nl")) == 2, timeout=20, what="2 rank pods")
    kubelet.bind(core, "nl-g0-r0", ns, node=a)
    kubelet.bind(core, "nl-g0-r1", ns, node=b)
    for name in ("nl-g0-r0", "nl-g0-r1"):
        kubelet.set_ready(core, name, ns)
    wait_for(lambda: _group0(kube, ns, "nl") == "Ready", timeout=20, what="Ready")
    old = {n: p["metadata"]["uid"] for n, p in pods(kube, ns, "nl").items()}

    # node b went quiet 20 s ago: lost at the default bound (30 s) 10 s from now, not before
    t0 = time.monotonic()
    _set_ready(core, b, "Unknown", seconds_ago=20)
    st = wait_for(lambda: (lambda s: s if (s.get("lastFailure") or {}).get("cause") == "node_lost"
                           else None)(_status(kube, ns, "nl")), timeout=30,
                  what="the group dead with cause node_lost")
    took = time.monotonic() - t0
    assert 8.5 <= took <= 20, f"lost {took:.1f}s after the node went Unknown 20 s back (bound 30)"
    lf = st["lastFailure"]
    assert (lf["node"], lf["rank"], lf["pod"], lf["reason"]) == (b, 1, "nl-g0-r1", "NodeLost")
    assert f"node {b} of rank 1 has been Ready=Unknown" in lf["message"]
    assert any("node_lost" in e["message"] for e in events(kube, ns, "EngineDied"))

    # rank 1's pod (bound to the lost node) is gone at once: nothing would ever confirm it; rank 0
    # on the healthy node stops gracefully, as any dead group's ranks do
    def old_r1_gone():
        now = pods(kube, ns, "nl")
        return "nl-g0-r1" not in now or now["nl-g0-r1"]["metadata"]["uid"] != old["nl-g0-r1"]
    wait_for(old_r1_gone, timeout=10, what="rank 1's pod removed with grace 0")
    r0 = pods(kube, ns, "nl").get("nl-g0-r0")
    assert r0 is None or r0["metadata"]["uid"] != old["nl-g0-r0"] or \
        r0["metadata"].get("deletionTimestamp"), "the healthy rank is stopped too"
    kubelet.finish_deletion(core, "nl-g0-r0", ns)

    def recreated():
        now = pods(kube, ns, "nl")
        fresh = {n: p for n, p in now.items() if p["metadata"]["uid"] not in old.values()}
        return len(fresh) == 2 and fresh
    wait_for(recreated, timeout=20, what="both ranks recreated")
    for name in ("nl-g0-r0", "nl-g0-r1"):
        kubelet.bind(core, name, ns, node=a)
        kubelet.set_ready(core, name, ns)
    wait_for(lambda: _group0(kube, ns, "nl") == "Ready", timeout=20, what="Ready again")

    # the node comes back: no second restart, no second copy of the group
    _set_ready(core, b, "True")
    wait_for(lambda: _status(kube, ns, "nl").get("restartCount") == 1, timeout=5)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        assert _status(kube, ns, "nl").get("restartCount") == 1
        assert _group0(kube, ns, "nl") == "Ready" and len(pods(kube, ns, "nl")) == 2
        time.sleep(0.5)


def test_frontends_spread_over_nodes_and_tolerate_a_lost_node_for_the_bound(ns, kube):
    create_ie(kube, engine("fe", ns).restart(nodeLostSeconds=45).manifest())
    dep = wait_for(lambda: kube.get("apps/v1", "deployments", ns, L.frontend_name("fe")),
                   timeout=20, what="the frontend Deployment")
    spec = dep["spec"]["template"]["spec"]
    tol = {t["key"]: t.get("tolerationSeconds") for t in spec["tolerations"]}
    assert tol == {"node.kubernetes.io/unreachable": 45, "node.kubernetes.io/not-ready": 45}
    (spread,) = spec["topologySpreadConstraints"]
    assert (spread["topologyKey"], spread["whenUnsatisfiable"]) == (
        "kubernetes.io/hostname", "ScheduleAnyway")
