"""Placement by pod template on real nodes: one of the two nodes is tainted (a GPU pool stand-in),
the other labelled; engine and frontend pods land only where their `template` says (a
nodeSelector, a toleration), a pod pinned to the tainted node without the toleration stays
unscheduled. Then a model served from `pvc://CLAIM/PATH` (a hostPath PersistentVolume holding
the project's model, bound to a claim). The taint, the label and the volume are removed again."""

from __future__ import annotations

import contextlib

import pytest
from shoal.devcluster.layout import MODEL_HOST_DIR
from support.cluster import inference_engine
from support.wait import wait_for

from e2e.e2e_helpers import completes, pods, service_url, wait_ready

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

TAINT_KEY, LABEL_KEY = "shoal-test/dedicated", "shoal-test/pool"


def _engine(ns: str, name: str, engine_template: dict | None = None,
            frontend_template: dict | None = None, **spec) -> dict:
    body = inference_engine(name, **spec)
    body["metadata"]["namespace"] = ns
    if engine_template:
        body["spec"]["engine"]["template"] = engine_template
    if frontend_template:
        body["spec"]["frontend"]["template"] = frontend_template
    return body


def _nodes_of(cluster, ns: str, name: str, component: str) -> list[str]:
    return sorted(p["spec"].get("nodeName") or "" for p in
                  pods(cluster, ns, f"shoal.dev/engine={name},shoal.dev/component={component}"))


@contextlib.contextmanager
def _tainted_and_labelled(cluster):
    """The first node tainted NoSchedule (running pods stay), the second labelled."""
    names = sorted(n["metadata"]["name"] for n in cluster.get("nodes")["items"])
    assert len(names) == 2, names
    tainted, labelled = names
    try:
        cluster.kubectl("taint", "nodes", tainted, f"{TAINT_KEY}=placement:NoSchedule")
        cluster.kubectl("label", "nodes", labelled, f"{LABEL_KEY}=placement")
        yield tainted, labelled
    finally:
        cluster.kubectl("taint", "nodes", tainted, f"{TAINT_KEY}-", check=False)
        cluster.kubectl("label", "nodes", labelled, f"{LABEL_KEY}-", check=False)


def test_pods_land_only_where_the_template_says(cluster, new_ns):
    ns = new_ns("e2e-place")
    with _tainted_and_labelled(cluster) as (tainted, labelled):
        on_label = {"spec": {"nodeSelector": {LABEL_KEY: "placement"}}}
        tolerate = {"key": TAINT_KEY, "operator": "Equal", "value": "placement",
                    "effect": "NoSchedule"}
        on_taint = {"metadata": {"labels": {"team": "placement"}},
                    "spec": {"nodeSelector": {"kubernetes.io/hostname": tainted},
                             "tolerations": [tolerate]}}
        untolerated = {"spec": {"nodeSelector": {"kubernetes.io/hostname": tainted}}}
        cluster.apply(_engine(ns, "labelled", on_label, on_label, replicas=2))
        cluster.apply(_engine(ns, "tainted", on_taint, on_label))
        cluster.apply(_engine(ns, "refused", untolerated))

        wait_ready(cluster, ns, "labelled", "2/2")
        wait_ready(cluster, ns, "tainted", "1/1")
        assert _nodes_of(cluster, ns, "labelled", "engine") == [labelled, labelled]
        assert _nodes_of(cluster, ns, "labelled", "frontend") == [labelled]
        assert _nodes_of(cluster, ns, "tainted", "engine") == [tainted]
        assert _nodes_of(cluster, ns, "tainted", "frontend") == [labelled]
        (pod,) = pods(cluster, ns, "shoal.dev/engine=tainted,shoal.dev/component=engine")
        assert pod["metadata"]["labels"]["team"] == "placement"
        assert tolerate in pod["spec"]["tolerations"]
        assert completes(service_url(cluster, ns, "tainted"))

        def unschedulable():
            (p,) = pods(cluster, ns, "shoal.dev/engine=refused,shoal.dev/component=engine")
            cond = {c["type"]: c for c in p["status"].get("conditions") or []}
            sched = cond.get("PodScheduled") or {}
            return sched.get("reason") == "Unschedulable" and not p["spec"].get("nodeName") \
                and sched

        sched = wait_for(unschedulable, timeout=60, interval=1,
                         what="the pod without the toleration left unscheduled")
        assert "taint" in sched.get("message", ""), sched


def test_a_pvc_model_is_served_from_its_claim(cluster, new_ns):
    ns = new_ns("e2e-pvc")
    pv = f"shoal-models-{ns}"
    volume = {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
              "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadOnlyMany"],
                       "persistentVolumeReclaimPolicy": "Retain", "storageClassName": pv,
                       "hostPath": {"path": str(MODEL_HOST_DIR), "type": "Directory"},
                       "claimRef": {"namespace": ns, "name": "models"}}}
    claim = {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
             "metadata": {"name": "models", "namespace": ns},
             "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": pv,
                      "resources": {"requests": {"storage": "1Gi"}}}}
    try:
        cluster.apply(volume)
        cluster.apply(claim)
        body = _engine(ns, "frompvc", model="pvc://models/shoal-tiny")  # no modelVolume
        assert "modelVolume" not in body["spec"]
        cluster.apply(body)
        wait_ready(cluster, ns, "frompvc", "1/1")
        (pod,) = pods(cluster, ns, "shoal.dev/engine=frompvc,shoal.dev/component=engine")
        (c,) = pod["spec"]["containers"]
        assert c["args"][:2] == ["serve", "/mnt/models/shoal-tiny"]
        assert {"name": "model", "persistentVolumeClaim": {"claimName": "models",
                                                           "readOnly": True}} \
            in pod["spec"]["volumes"]
        assert completes(service_url(cluster, ns, "frompvc"))
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        cluster.kubectl("delete", "pv", pv, "--wait=false", check=False)
