"""Node health as the operator reads it from Node objects, and which node events wake whom."""

from __future__ import annotations

import pytest
from shoal.operator import labels as L
from shoal.operator.node_index import NodeIndex, ReadyChanges, engines_on
from shoal.operator.node_loss import NodeHealth


def node(status: str | None, since: str = "2026-12-04T10:00:00Z") -> dict:
    conds = [{"type": "MemoryPressure", "status": "False"}]
    if status is not None:
        conds.append({"type": "Ready", "status": status, "lastTransitionTime": since,
                      "reason": "NodeStatusUnknown", "message": "Kubelet stopped posting"})
    return {"metadata": {"name": "n1"}, "status": {"conditions": conds}}


@pytest.mark.parametrize("body, ready, since, healthy", [
    (node("True"), "True", "2026-12-04T10:00:00Z", True),
    (node("Unknown"), "Unknown", "2026-12-04T10:00:00Z", False),
    (node("False"), "False", "2026-12-04T10:00:00Z", False),
    (node(None), "True", None, True),  # a node that never reported is not judged lost
    ({"metadata": {"name": "n1"}}, "True", None, True),
])
def test_a_nodes_health_is_its_ready_condition(body, ready, since, healthy):
    h = NodeHealth.of(body)
    assert (h.ready, h.since, h.healthy) == (ready, since, healthy)


@pytest.mark.parametrize("seen, expect", [
    (["True"], [False]),  # first seen healthy: nothing to do
    (["Unknown"], [True]),  # first seen unhealthy (an operator started during a loss)
    (["True", "True", "True"], [False, False, False]),  # heartbeats wake nobody
    (["True", "Unknown", "Unknown", "True"], [False, True, False, True]),
    (["True", None], [False, True]),  # deleted
])
def test_only_a_change_of_ready_wakes_the_engines_on_a_node(seen, expect):
    changes = ReadyChanges()
    got = [changes.changed("n1", None if s is None else NodeHealth(ready=s)) for s in seen]
    assert got == expect


def test_the_engines_on_a_node_are_found_from_the_pod_index():
    def pod(node: str) -> dict:
        return {"spec": {"nodeName": node}}
    index = {("a", "x", L.COMPONENT_ENGINE): [pod("n1"), pod("n2")],
             ("a", "y", L.COMPONENT_ENGINE): [pod("n2")],
             ("b", "z", L.COMPONENT_FRONTEND): [pod("n1")]}
    assert engines_on(index, "n1") == {("a", "x")}
    assert engines_on(index, "n2") == {("a", "x"), ("a", "y")}
    assert engines_on(None, "n1") == set()


def test_the_index_answers_once_attached_and_a_get_before():
    asked = []
    idx = NodeIndex(lambda name: asked.append(name) or NodeHealth(ready="False"))
    assert idx.health(["n1", "", "n1"]) == {"n1": NodeHealth(ready="False")} and asked == ["n1"]
    idx.attach({"n1": [NodeHealth(ready="True")]})
    assert idx.health(["n1", "n2"]) == {"n1": NodeHealth(ready="True")}
