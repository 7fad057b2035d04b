"""Reconciler passes run in-process against the real API server (no operator watching `opi-*`),
counting every write; and a real operator killed mid-way and started again."""

from __future__ import annotations

import pytest
from shoal.contract.termination import Cause, encode
from shoal.operator import labels as L
from shoal.operator.kube import Kube
from shoal.operator.reconcile import Reconciler
from support import kubelet
from support.builders import engine
from support.engine_api import cleanup_namespace, create_ie, events, ie, pods
from support.operator_proc import OperatorProcess
from support.wait import wait_for

pytestmark = pytest.mark.k8s


def _fresh(control_plane) -> Reconciler:
    """A new reconciler with a cold cache: what a restarted operator starts with."""
    return Reconciler(Kube(control_plane.api_client()))


def _writes(r: Reconciler) -> dict:
    return {f"{v} {p}": n for (v, p), n in r.kube.writes.items()}


def test_a_second_pass_writes_nothing(control_plane, quiet_ns, kube, core):
    ns = quiet_ns
    body = create_ie(kube, engine("idem", ns).groups(2).ranks(2).manifest())
    r = _fresh(control_plane)
    r.reconcile(body)
    assert _writes(r) == {"create deployments": 1, "create services": 2, "create configmaps": 1,
                          "create serviceaccounts": 1, "create roles": 1, "create rolebindings": 1,
                          "create poddisruptionbudgets": 1, "create pods": 4,
                          "patch/status inferenceengines": 1}
    r.kube.writes.clear()
    r.reconcile(body)
    assert _writes(r) == {}, "a second pass must change nothing"
    cold = _fresh(control_plane)
    cold.reconcile(body)
    assert _writes(cold) == {}, "a restarted operator must change nothing either"

    for name in pods(kube, ns, "idem"):
        kubelet.set_ready(core, name, ns)
    r.kube.writes.clear()
    r.reconcile(body)
    assert _writes(r) == {"patch configmaps": 1, "patch/status inferenceengines": 1}
    r.kube.writes.clear()
    r.reconcile(body)
    assert _writes(r) == {}


def test_a_recorded_death_is_acted_on_once(control_plane, quiet_ns, kube, core):
    ns = quiet_ns
    body = create_ie(
        kube,
        engine("once", ns)
        .ranks(2)
        .restart(backoffBaseSeconds=600, backoffMaxSeconds=600)
        .manifest(),
    )
    r = _fresh(control_plane)
    r.reconcile(body)
    kubelet.set_terminated(core, "once-g0-r1", ns, exit_code=137, reason="OOMKilled")
    r.reconcile(body)
    st = ie(kube, ns, "once")["status"]
    assert st["restartCount"] == 1 and st["lastFailure"]["cause"] == "oom_killed"
    assert st["lastFailure"]["signal"] == 9 and st["groups"][0]["phase"] == "BackingOff"
    wait_for(lambda: pods(kube, ns, "once") == {}, timeout=10, what="the dead group torn down")
    r.kube.writes.clear()
    _fresh(control_plane).reconcile(body)
    r.reconcile(body)
    assert _writes(r) == {} and ie(kube, ns, "once")["status"]["restartCount"] == 1


def test_an_operator_killed_midway_resumes_without_duplicates(
    control_plane, crd_installed, kube, core, tmp_path
):
    log = tmp_path / "operator.log"
    ns = control_plane.new_namespace("opr")
    op = OperatorProcess(control_plane, "opr-*", log).start()
    try:
        create_ie(
            kube, engine("rs", ns).groups(3).ranks(2).restart(backoffBaseSeconds=3).manifest()
        )
        wait_for(lambda: len(pods(kube, ns, "rs")) == 6, timeout=20, what="6 pods")
        for name in pods(kube, ns, "rs"):
            kubelet.set_ready(core, name, ns)
        wait_for(
            lambda: kubelet.ready_frontends(core, "rs", ns) > 0, timeout=10, what="the frontend pod"
        )
        wait_for(lambda: (ie(kube, ns, "rs").get("status") or {}).get("ready") == "3/3", timeout=10)
        kubelet.set_terminated(
            core, "rs-g2-r0", ns, exit_code=1, message=encode(Cause.ENGINE_ERROR, "boom", rank=0)
        )
        wait_for(
            lambda: (ie(kube, ns, "rs").get("status") or {}).get("restartCount") == 1, timeout=10
        )
        op.stop(kill=True)  # SIGKILL mid-backoff: no chance to clean up

        uids = {n: p["metadata"]["uid"] for n, p in pods(kube, ns, "rs").items()}
        kube.delete("v1", "pods", ns, "rs-g1-r1")  # someone deletes a rank while nobody watches
        op = OperatorProcess(control_plane, "opr-*", log).start()

        def healed():
            now = pods(kube, ns, "rs")
            return len(now) == 6 and now
        wait_for(healed, timeout=30, what="all 6 ranks back")
        for name in pods(kube, ns, "rs"):
            kubelet.set_ready(core, name, ns)
        st = wait_for(
            lambda: (lambda s: s if s.get("ready") == "3/3" else None)(
                ie(kube, ns, "rs").get("status") or {}
            ),
            timeout=15,
            what="3/3 ready again",
        )
        assert st["restartCount"] == 2  # the death before the kill + the vanished rank after it
        now = pods(kube, ns, "rs")
        assert sorted(now) == sorted(f"rs-g{g}-r{r}" for g in range(3) for r in range(2))
        assert now["rs-g0-r0"]["metadata"]["uid"] == uids["rs-g0-r0"], (
            "a healthy group was recreated"
        )
        sel = f"{L.LABEL_ENGINE}=rs"
        assert len(kube.list("apps/v1", "deployments", ns, sel)) == 1
        assert len(kube.list("v1", "services", ns, sel)) == 2
        assert len(kube.list("v1", "configmaps", ns, sel)) == 1
    finally:
        cleanup_namespace(kube, ns)
        op.stop()


@pytest.mark.parametrize(
    "policy, deaths, why",
    [
        ({"policy": "Never"}, 1, "restartPolicy.policy is Never"),
        (
            {"maxRestarts": 1, "backoffBaseSeconds": 0},
            2,
            "1 consecutive restarts reached restartPolicy.maxRestarts",
        ),
    ],
)
def test_restart_policy_limits_leave_the_group_failed(
    control_plane, quiet_ns, kube, core, policy, deaths, why
):
    ns = quiet_ns
    body = create_ie(kube, engine("lim", ns).restart(**policy).manifest())
    r = _fresh(control_plane)
    r.reconcile(body)
    for death in range(deaths):
        # The in-process reconciler has no wake-ups: the test runs the passes (backoff 0 is due
        # at the next whole second, deadlines being stored rounded up).
        wait_for(lambda: r.reconcile(body) and "lim-g0-r0" in pods(kube, ns, "lim"), timeout=10,
                 interval=0.3, what="rank 0 pod")
        kubelet.set_terminated(
            core, "lim-g0-r0", ns, exit_code=1, message=encode(Cause.ENGINE_ERROR, f"death {death}")
        )
        r.reconcile(body)  # records the death
        if death < deaths - 1:
            wait_for(lambda: not pods(kube, ns, "lim"), timeout=10, what="the group torn down")
    st = ie(kube, ns, "lim")["status"]
    assert st["groups"][0]["phase"] == "Failed" and why in st["groups"][0]["message"]
    assert st["phase"] == "Failed" and st["lastFailure"]["message"] == f"death {deaths - 1}"
    r.reconcile(body)
    assert "lim-g0-r0" in pods(kube, ns, "lim"), "the failed pod is kept for its logs"
    assert ie(kube, ns, "lim")["status"]["groups"][0]["phase"] == "Failed"


def test_a_group_stuck_not_ready_is_stalled_and_restarted(control_plane, quiet_ns, kube):
    """A rank that never becomes Ready (here: its image never pulls) is a failure with cause
    `stalled` once engine.startupTimeoutSeconds + STALL_MARGIN_SECONDS have passed since the
    group was created; until then the waiting reason is in the group's message and an Event,
    and the pass plans its next look at the deadline."""
    import datetime as dt

    from shoal.operator.observed import STALL_MARGIN_SECONDS

    ns = quiet_ns
    body = create_ie(kube, engine("stall", ns).set(engine={"startupTimeoutSeconds": 60}).manifest())
    clock = {"now": dt.datetime.now(dt.timezone.utc)}
    r = Reconciler(Kube(control_plane.api_client()), clock=lambda: clock["now"])
    r.reconcile(body)
    pod = wait_for(lambda: pods(kube, ns, "stall").get("stall-g0-r0"), timeout=10, what="rank 0")
    kube.request(
        "PATCH",
        f"/api/v1/namespaces/{ns}/pods/stall-g0-r0/status",
        content_type="application/merge-patch+json",
        body={
            "status": {
                "phase": "Pending",
                "containerStatuses": [
                    {
                        "name": L.ENGINE_CONTAINER,
                        "image": "shoal:nope",
                        "imageID": "",
                        "ready": False,
                        "restartCount": 0,
                        "state": {
                            "waiting": {
                                "reason": "ImagePullBackOff",
                                "message": 'Back-off pulling image "shoal:nope"',
                            }
                        },
                    }
                ],
            }
        },
    )
    created = dt.datetime.strptime(
        pod["metadata"]["creationTimestamp"], "%Y-%m-%dT%H:%M:%SZ"
    ).replace(tzinfo=dt.timezone.utc)
    limit = 60 + STALL_MARGIN_SECONDS

    clock["now"] = created + dt.timedelta(seconds=limit - 5)
    out = r.reconcile(body)
    g = ie(kube, ns, "stall")["status"]["groups"][0]
    assert g["phase"] == "Starting" and "rank 0: ImagePullBackOff" in g["message"], g
    assert 4 <= out.requeue_after <= 5, out.requeue_after  # the next look is at the deadline
    assert "ImagePullBackOff" in events(kube, ns, "RankWaiting")[0]["message"]

    clock["now"] = created + dt.timedelta(seconds=limit + 1)
    r.reconcile(body)
    st = ie(kube, ns, "stall")["status"]
    assert st["lastFailure"]["cause"] == "stalled" and st["lastFailure"]["permanent"] is False
    assert (
        "ImagePullBackOff" in st["lastFailure"]["message"]
        and f"limit {limit}s" in st["lastFailure"]["message"]
    )
    assert st["groups"][0]["phase"] == "BackingOff" and st["restartCount"] == 1
    assert len(events(kube, ns, "RankWaiting")) == 1, "one Event per change of the waiting reason"


def test_a_death_under_an_invalid_spec_is_reported_not_restarted(
    control_plane, quiet_ns, kube, core
):
    """The spec became invalid while a group ran: nothing is created or restarted, but a rank's
    death is still recorded and reported."""
    ns = quiet_ns
    body = create_ie(kube, engine("inv", ns).ranks(2).manifest())
    r = _fresh(control_plane)
    r.reconcile(body)
    wait_for(lambda: len(pods(kube, ns, "inv")) == 2, timeout=10, what="2 ranks")
    kube.patch(L.API_VERSION, L.PLURAL, ns, "inv", {"spec": {"tensorParallelSize": 3}})
    r.reconcile(body)
    assert ie(kube, ns, "inv")["status"]["conditions"][0]["status"] == "False"  # SpecValid
    kubelet.set_terminated(
        core, "inv-g0-r1", ns, exit_code=1, message=encode(Cause.ENGINE_ERROR, "boom", rank=1)
    )
    r.reconcile(body)
    st = ie(kube, ns, "inv")["status"]
    assert st["lastFailure"]["pod"] == "inv-g0-r1" and st["lastFailure"]["cause"] == "engine_error"
    assert st["groups"][0]["phase"] == "Failed" and "spec is invalid" in st["groups"][0]["message"]
    assert (
        "not restarting while the spec is invalid" in events(kube, ns, "EngineDied")[0]["message"]
    )
    r.reconcile(body)
    assert set(pods(kube, ns, "inv")) == {"inv-g0-r0", "inv-g0-r1"}, "nothing deleted or created"


def test_drain_progress_is_written_once_per_new_count(control_plane, quiet_ns, kube, core):
    """The in-flight count of a draining rank 0 (read by the drain probes, injected here) is in
    the group's message: one status write when it changes, none while it stays."""
    ns = quiet_ns
    body = create_ie(kube, engine("dr", ns).groups(2).ranks(2).manifest())
    counts: dict[int, int] = {}
    r = Reconciler(Kube(control_plane.api_client()), in_flight=lambda namespace, name: dict(counts))
    r.reconcile(body)
    for name in wait_for(
        lambda: (lambda p: p if len(p) == 4 else None)(pods(kube, ns, "dr")), timeout=10
    ):
        kubelet.bind(
            core, name, ns
        )  # a bound pod is deleted gracefully: rank 0 stays while it drains
        kubelet.set_ready(core, name, ns)
    r.reconcile(body)
    kube.patch(L.API_VERSION, L.PLURAL, ns, "dr", {"spec": {"replicas": 1}})
    out = r.reconcile(body)
    rank0_ip = pods(kube, ns, "dr")["dr-g1-r0"]["status"]["podIP"]  # as the kubelet reported it
    assert out.drain_probes == {1: f"http://{rank0_ip}:{L.HTTP_PORT}/metrics"}

    def group1():
        return next(g for g in ie(kube, ns, "dr")["status"]["groups"] if g["index"] == 1)

    for n, writes in ((3, 1), (3, 0), (0, 1)):
        counts[1] = n
        r.kube.writes.clear()
        r.reconcile(body)
        assert _writes(r) == ({"patch/status inferenceengines": 1} if writes else {}), (
            n,
            _writes(r),
        )
        assert group1()["message"].startswith(f"draining: {n} requests in flight")


def test_the_operator_reads_pods_from_its_index_not_a_list_per_pass(
    control_plane, crd_installed, kube, core, tmp_path
):
    """The operator process counts its own reads: a create -> Ready takes several passes, none
    of which LISTs pods (kopf's index holds them); each still GETs the resource (its memory)."""
    import json

    ns = control_plane.new_namespace("opr")  # before the start: kopf lists existing namespaces
    stats = tmp_path / "stats.json"
    op = OperatorProcess(
        control_plane, "opr-*", tmp_path / "operator.log", stats_path=stats
    ).start()
    try:
        create_ie(kube, engine("ix", ns).ranks(2).manifest())
        for name in wait_for(
            lambda: (lambda p: p if len(p) == 2 else None)(pods(kube, ns, "ix")), timeout=30
        ):
            kubelet.set_ready(core, name, ns)
        wait_for(
            lambda: (
                ((ie(kube, ns, "ix").get("status") or {}).get("groups") or [{}])[0].get("phase")
                == "Ready"
            ),
            timeout=20,
            what="group 0 Ready",
        )
    finally:
        cleanup_namespace(kube, ns)
        op.stop()  # the cleanup handler writes the final counts
    reads = json.loads(stats.read_text())["reads"]
    assert reads.get("get inferenceengines", 0) >= 3, reads
    assert "list pods" not in reads, reads


def test_a_template_field_the_operator_owns_is_kept_by_the_server_and_named(
    control_plane, quiet_ns, kube
):
    """The API server keeps every template field (none pruned), so the operator sees one it
    must refuse and names it in SpecValid; nothing is created until it is fixed."""
    ns = quiet_ns
    owned = {"spec": {"hostNetwork": True,
                      "containers": [{"name": "engine", "command": ["python"]}]}}
    body = create_ie(kube, engine("own", ns).engine(template=owned).manifest())
    assert body["spec"]["engine"]["template"] == owned, "the server pruned a template field"
    r = _fresh(control_plane)
    r.reconcile(body)
    cond = next(c for c in ie(kube, ns, "own")["status"]["conditions"] if c["type"] == "SpecValid")
    assert cond["status"] == "False"
    assert "spec.engine.template.spec.hostNetwork is not supported" in cond["message"]
    assert "spec.engine.template.spec.containers[engine].command is set by the operator" \
        in cond["message"]
    assert pods(kube, ns, "own") == {} and _writes(r) == {"patch/status inferenceengines": 1}


def test_a_frontend_template_reaches_the_deployment_and_leaves_it_when_removed(
    control_plane, quiet_ns, kube
):
    ns = quiet_ns
    placed = {"metadata": {"labels": {"team": "search"}},
              "spec": {"nodeSelector": {"pool": "cpu"},
                       "tolerations": [{"key": "dedicated", "operator": "Exists"}]}}
    body = create_ie(kube, engine("fe", ns).frontend(template=placed).manifest())
    r = _fresh(control_plane)
    r.reconcile(body)
    pod = kube.get("apps/v1", "deployments", ns, "fe-frontend")["spec"]["template"]
    assert pod["spec"]["nodeSelector"] == {"pool": "cpu"}
    # The template's toleration is added to the operator's lost-node ones (evicted after
    # restartPolicy.nodeLostSeconds, not Kubernetes' 5 minutes).
    lost_node = [{"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 30}
                 for key in ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready")]
    assert pod["spec"]["tolerations"] == lost_node + placed["spec"]["tolerations"]
    assert pod["metadata"]["labels"]["team"] == "search"
    kube.patch(L.API_VERSION, L.PLURAL, ns, "fe", {"spec": {"frontend": {"template": None}}})
    r.reconcile(ie(kube, ns, "fe"))
    pod = kube.get("apps/v1", "deployments", ns, "fe-frontend")["spec"]["template"]
    assert "nodeSelector" not in pod["spec"] and pod["spec"]["tolerations"] == lost_node
    assert "team" not in pod["metadata"]["labels"]
    assert pod["spec"]["serviceAccountName"] == "fe-frontend"
