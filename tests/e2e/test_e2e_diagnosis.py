"""When pods do not come up, the harness names the cause from the cluster's own objects
(shoal.devcluster.explain): fed here the real scheduler's, kubelet's and
API server's output for a pod no node fits, a pod whose image the node lacks, and a tainted node.
"""

from __future__ import annotations

import pytest
from shoal.devcluster import explain
from support.wait import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

TAINT = "e2e.shoal.dev/diagnosis"


def pod(name: str, **spec) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 0, **spec}}


def test_stuck_pods_are_explained_by_scheduler_kubelet_and_node_state(cluster, new_ns):
    ns = new_ns("e2e-diagnosis")
    node = cluster.state["nodes"][0]
    cluster.kubectl("taint", "node", node, f"{TAINT}=1:NoSchedule")
    try:
        for body in (
            pod("nowhere", nodeSelector={"shoal.dev/no-such-label": "x"},
                containers=[{"name": "c", "image": "localhost/shoal/pause:3.4.1",
                             "imagePullPolicy": "Never"}]),
            pod("no-image", nodeName=cluster.state["nodes"][1],
                containers=[{"name": "c", "image": "localhost/shoal/absent:0",
                             "imagePullPolicy": "Never"}]),
        ):
            body["metadata"]["namespace"] = ns
            cluster.apply(body)

        def explained():
            text = explain.explain(cluster.get("pods", "-n", ns), cluster.get("nodes"),
                                           cluster.get("events", "-n", ns))
            lines = text.splitlines()
            nowhere = [ln for ln in lines if ln.startswith("pod nowhere:")]
            no_image = [ln for ln in lines if ln.startswith("pod no-image:")]
            tainted = [ln for ln in lines if ln.startswith(f"node {node}:")]
            if nowhere and "nodes are available" in nowhere[0] and no_image and \
                    "ErrImageNeverPull" in no_image[0] and tainted:
                return nowhere[0], no_image[0], tainted[0], text
            return None

        nowhere, no_image, tainted, text = wait_for(explained, timeout=120, interval=1,
                                                    what="the scheduler's and kubelet's reasons")
        # The scheduler's verdict on both nodes: one tainted, the other not matching.
        assert "PodScheduled: Unschedulable" in nowhere and "0/2 nodes are available" in nowhere
        assert f"had taint {{{TAINT}: 1}}" in nowhere and "didn't match" in nowhere
        assert "node (none)" in nowhere
        assert "container c waiting: ErrImageNeverPull" in no_image
        assert "localhost/shoal/absent:0" in no_image
        assert f"taints {TAINT}:NoSchedule" in tainted
        assert any(ln.startswith("event Pod/") and "FailedScheduling" in ln
                   for ln in text.splitlines()), text
    finally:
        cluster.kubectl("taint", "node", node, f"{TAINT}-", check=False)
    assert not [ln for ln in explain.node_lines(cluster.get("nodes")["items"])
                if TAINT in ln]
