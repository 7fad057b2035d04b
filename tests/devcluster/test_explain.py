"""Why pods are not running, from the API's objects (shoal.devcluster.explain)."""

from __future__ import annotations

import pytest
from shoal.devcluster import explain


def pod(name, phase="Pending", node=None, conditions=(), containers=()):
    return {"metadata": {"name": name}, "spec": {"nodeName": node} if node else {},
            "status": {"phase": phase, "conditions": list(conditions),
                       "containerStatuses": list(containers)}}


READY = {"type": "Ready", "status": "True"}
UNSCHEDULABLE = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                 "message": "0/2 nodes are available"}
NEVER_PULL = {"name": "c", "state": {"waiting": {"reason": "ErrImageNeverPull",
                                                  "message": "image x absent"}}}
CRASHED = {"name": "c", "restartCount": 3, "state": {"waiting": {"reason": "CrashLoopBackOff"}},
           "lastState": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}


@pytest.mark.parametrize("pods, want", [
    ([pod("ok", "Running", "n1", [READY])], []),
    ([pod("stuck", conditions=[UNSCHEDULABLE])],
     ["pod stuck: Pending; node (none); PodScheduled: Unschedulable 0/2 nodes are available"]),
    ([pod("img", node="n2", containers=[NEVER_PULL])],
     ["pod img: Pending; node n2; container c waiting: ErrImageNeverPull image x absent"]),
    ([pod("crash", "Running", "n1", containers=[CRASHED])],
     ["pod crash: Running; node n1; container c waiting: CrashLoopBackOff; "
      "container c last exit 137 (OOMKilled), restarts 3"]),
])
def test_pod_lines(pods, want):
    assert explain.pod_lines(pods) == want


def node(name, ready="True", pressure=None, taints=()):
    conds = [{"type": "Ready", "status": ready, "reason": "KubeletNotReady" if ready != "True"
              else ""}]
    if pressure:
        conds.append({"type": pressure, "status": "True", "message": "low"})
    return {"metadata": {"name": name}, "status": {"conditions": conds},
            "spec": {"taints": [{"key": k, "effect": "NoSchedule"} for k in taints]}}


@pytest.mark.parametrize("nodes, want", [
    ([node("n1")], []),
    ([node("n1", ready="False")], ["node n1: not Ready: KubeletNotReady"]),
    ([node("n1", pressure="DiskPressure")], ["node n1: DiskPressure: low"]),
    ([node("n1", taints=["t"])], ["node n1: taints t:NoSchedule"]),
])
def test_node_lines(nodes, want):
    assert explain.node_lines(nodes) == want


def test_event_lines_keep_the_latest_warnings_oldest_first():
    events = [{"type": "Warning", "lastTimestamp": f"2026-01-01T00:00:0{i}Z", "reason": f"R{i}",
               "count": 1, "message": "m", "involvedObject": {"kind": "Pod", "name": "p"}}
              for i in range(5)] + [{"type": "Normal", "reason": "Pulled",
                                     "involvedObject": {}}]
    assert explain.event_lines(events, limit=2) == ["event Pod/p: R3 (x1) m",
                                                    "event Pod/p: R4 (x1) m"]


def test_nothing_wrong():
    assert explain.explain({"items": []}, {"items": [node("n1")]}, {"items": []}) == \
        "(every pod is running and every node is ready)"
