"""The autoscaler against the real API server: in-process passes (nobody watches `opi-*`), the
engines' /metrics injected as the scraper's answers and time as the reconciler's clock: one
scale-up (pods created, Event, status, an HPA on the same engine in a condition), and scale to
zero and back when a router renews the wake Lease the operator created (the router's own
patch, k8s_wake.wake_patch)."""

from __future__ import annotations

import datetime as dt

import pytest
from shoal.contract import discovery
from shoal.operator import labels as L
from shoal.operator.autoscale_metrics import Sample
from shoal.operator.kube import Kube
from shoal.operator.reconcile import Reconciler
from shoal.router.k8s_wake import wake_patch
from support import kubelet
from support.builders import engine
from support.engine_api import condition, create_ie, events, ie, pods

pytestmark = pytest.mark.k8s


class World:
    """The clock and what each group's rank 0 answers."""

    def __init__(self):
        self.now = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
        self.load: dict[int, float] = {}
        self.scraped: list[dict] = []

    def clock(self):
        return self.now

    def scrape(self, namespace, name, targets):
        self.scraped.append(dict(targets))
        return {g: Sample(running=self.load.get(g, 0), waiting=0, kv_usage=0) for g in targets}


def _ready_all(kube, core, ns, name):
    for p in pods(kube, ns, name):
        kubelet.set_ready(core, p, ns)


def _body(ns, name, **a):
    spec = {"minReplicas": 1, "maxReplicas": 3, "requestsPerGroup": 4,
            "scaleUpStabilizationSeconds": 0, "scaleDownDelaySeconds": 30, **a}
    return engine(name, ns).set(autoscaling=spec).manifest()


def test_load_scales_up_and_an_hpa_on_the_engine_is_reported(control_plane, quiet_ns, kube,
                                                             core):
    ns, w = quiet_ns, World()
    kube.request("POST", f"/apis/autoscaling/v1/namespaces/{ns}/horizontalpodautoscalers",
                 body={"apiVersion": "autoscaling/v1", "kind": "HorizontalPodAutoscaler",
                       "metadata": {"name": "up-hpa"},
                       "spec": {"scaleTargetRef": {"apiVersion": L.API_VERSION, "kind": L.KIND,
                                                   "name": "up"},
                                "minReplicas": 1, "maxReplicas": 5}})
    body = create_ie(kube, _body(ns, "up"))
    r = Reconciler(Kube(control_plane.api_client()), clock=w.clock, scrape=w.scrape)
    r.reconcile(body)
    assert set(pods(kube, ns, "up")) == {"up-g0-r0"}
    _ready_all(kube, core, ns, "up")
    r.reconcile(body)  # group 0 becomes Ready
    w.load = {0: 10}
    w.now += dt.timedelta(seconds=15)
    r.reconcile(body)
    assert set(pods(kube, ns, "up")) == {"up-g0-r0", "up-g1-r0", "up-g2-r0"}
    rank0 = pods(kube, ns, "up")["up-g0-r0"]["status"]["podIP"]
    assert w.scraped[-1] == {0: f"http://{rank0}:{L.HTTP_PORT}/metrics"}
    st = ie(kube, ns, "up")["status"]
    assert (st["autoscaling"]["desiredGroups"], st["autoscaling"]["value"]) == (3, 10.0)
    assert [e["message"].split(":")[0] for e in events(kube, ns, "ScaledUp")] == [
        "1 -> 3 groups"]
    c = condition(ie(kube, ns, "up"), "Autoscaling")
    assert (c["status"], c["reason"]) == ("False", "HPAConflict") and "up-hpa" in c["message"]


def test_idle_scales_to_zero_and_a_wake_brings_a_group_back(control_plane, quiet_ns, kube, core):
    ns, w = quiet_ns, World()
    body = create_ie(kube, _body(ns, "zero", minReplicas=0))
    r = Reconciler(Kube(control_plane.api_client()), clock=w.clock, scrape=w.scrape)
    r.reconcile(body)
    _ready_all(kube, core, ns, "zero")
    r.reconcile(body)
    r.reconcile(body)  # idle: the scale-down delay starts
    w.now += dt.timedelta(seconds=30)
    r.reconcile(body)
    st = ie(kube, ns, "zero")["status"]
    assert st["autoscaling"]["desiredGroups"] == 0 and events(kube, ns, "ScaledDown")
    # The closed window's keys are gone from the stored status (a merge patch keeps what it
    # does not name: the next pass would read the window back).
    assert not {"downSince", "downTo"} & set(st["autoscaling"]), st["autoscaling"]
    r.reconcile(body)
    assert pods(kube, ns, "zero") == {}, "the group drained and went"
    r.reconcile(body)
    assert pods(kube, ns, "zero") == {}, "no wake: nothing starts"
    lease = kube.get("coordination.k8s.io/v1", "leases", ns, discovery.wake_lease_name("zero"))
    assert lease is not None and not lease["spec"].get("renewTime"), "created, never renewed"
    kube.patch("coordination.k8s.io/v1", "leases", ns, "zero-wake",
               wake_patch("zero-frontend-x", w.now + dt.timedelta(seconds=1)))
    w.now += dt.timedelta(seconds=2)
    r.reconcile(body)
    assert set(pods(kube, ns, "zero")) == {"zero-g0-r0"}
    assert "wake requested" in events(kube, ns, "ScaledUp")[0]["message"]
