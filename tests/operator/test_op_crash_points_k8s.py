"""The operator dies at a chosen point and a new one resumes from the resource's status alone.

Where an operator can die matters only between two of its API writes: everything it knows lives
in the API (status, pods, Events). So the death is placed exactly: an in-process pass of the
real reconciler whose client raises right after the write the test picks (`CrashingKube`),
which leaves the API as a SIGKILL at that moment would (the pass's status patch never comes).
Then a real `shoal-operator` process starts on the same namespace, and the test checks what it
must: no duplicate pod, no lost drain, no second restart, no status regression. A fake kubelet
(support/kubelet.Kubelet) runs the pods. On real pods: tests/e2e/test_e2e_operator_restarts.py.
"""

from __future__ import annotations

import time

import pytest
from shoal.contract.termination import Cause, encode
from shoal.operator.kube import Kube
from shoal.operator.reconcile import Reconciler
from support import kubelet
from support.builders import engine
from support.engine_api import cleanup_namespace, create_ie, events, ie, pods
from support.operator_proc import OperatorProcess
from support.wait import wait_for

pytestmark = pytest.mark.k8s


class Crash(Exception):
    """The operator's death, right after the write the test picked."""


class CrashingKube(Kube):
    """The operator's own client, dying after the first write that `at(verb, plural, name)`
    picks; every write before it went to the API server as usual."""

    def __init__(self, api, at):
        super().__init__(api)
        self.at, self.done = at, []

    def _after(self, verb: str, plural: str, name: str) -> None:
        self.done.append((verb, plural, name))
        if self.at(verb, plural, name):
            raise Crash(f"died after {verb} {plural}/{name}")

    def create(self, obj):
        out = super().create(obj)
        self._after("create", obj["kind"].lower() + "s", obj["metadata"]["name"])
        return out

    def delete(self, api_version, plural, namespace, name, **kw):
        out = super().delete(api_version, plural, namespace, name, **kw)
        self._after("delete", plural, name)
        return out

    def patch(self, api_version, plural, namespace, name, patch, sub=None):
        out = super().patch(api_version, plural, namespace, name, patch, sub=sub)
        self._after("patch" + (f"/{sub}" if sub else ""), plural, name)
        return out


def _pass_dies(control_plane, body: dict, at) -> list:
    """One pass of the real reconciler that dies at `at`; returns the writes it made."""
    k = CrashingKube(control_plane.api_client(), at)
    with pytest.raises(Crash):
        Reconciler(k).reconcile(body)
    return k.done


def _status(kube, ns: str, name: str) -> dict:
    return (ie(kube, ns, name) or {}).get("status") or {}


@pytest.fixture
def world(control_plane, crd_installed, kube, core, tmp_path):
    """A namespace only this test's operator watches, and that operator's starter."""
    ns = control_plane.new_namespace("opc")
    ops: list[OperatorProcess] = []

    def start() -> OperatorProcess:
        ops.append(OperatorProcess(control_plane, "opc-*", tmp_path / "operator.log").start())
        return ops[-1]
    yield ns, start
    for op in ops:
        alive = op.proc.poll() is None
        op.stop()
        assert alive, f"the operator died:\n{op.tail()}"
    cleanup_namespace(kube, ns)


def _ready(kube, ns: str, name: str, ready: int, timeout: float = 30) -> dict:
    """`ready` groups Ready (status.readyReplicas: no frontend is Ready in this tier)."""
    return wait_for(lambda: (lambda s: s if s.get("readyReplicas") == ready else None)(
        _status(kube, ns, name)), timeout=timeout, what=f"{name} Ready {ready}")


def _steady(kube, ns: str, name: str, seconds: float, check) -> None:
    """`check(status, pods)` holds for `seconds` (what a second operator must not undo)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        check(_status(kube, ns, name), pods(kube, ns, name))
        time.sleep(0.5)


def test_died_after_the_first_rank_of_a_gang_restart_was_deleted(world, control_plane, kube,
                                                                 core):
    ns, start = world
    body = create_ie(kube, engine("gang", ns).ranks(2).restart(backoffBaseSeconds=1).manifest())
    Reconciler(Kube(control_plane.api_client())).reconcile(body)
    let = kubelet.Kubelet(core, ns, "gang")
    let.start()
    try:
        wait_for(lambda: all(p["spec"].get("nodeName") for p in pods(kube, ns, "gang").values())
                 and len(pods(kube, ns, "gang")) == 2, timeout=10, what="ranks bound")
        Reconciler(Kube(control_plane.api_client())).reconcile(body)
        assert _status(kube, ns, "gang").get("readyReplicas") == 1
        let.pause()
        kubelet.set_terminated(core, "gang-g0-r1", ns, exit_code=1,
                               message=encode(Cause.ENGINE_ERROR, "boom", rank=1))
        done = _pass_dies(control_plane, body, lambda verb, plural, name: verb == "delete")
        assert [d for d in done if d[0] == "delete"] == [("delete", "pods", "gang-g0-r0")]
        assert _status(kube, ns, "gang").get("restartCount", 0) == 0, "died before its status"
        old = {n: p["metadata"]["uid"] for n, p in pods(kube, ns, "gang").items()}

        start()
        let.resume()
        wait_for(lambda: _status(kube, ns, "gang").get("restartCount") == 1, timeout=20,
                 what="the death recorded by the new operator")

        def recreated():
            now = pods(kube, ns, "gang")
            return len(now) == 2 and not set(p["metadata"]["uid"] for p in now.values()) & \
                set(old.values())
        wait_for(recreated, timeout=30, what="the group recreated once")
        _ready(kube, ns, "gang", 1)

        def one_restart(st, now):
            assert st.get("restartCount") == 1, st
            assert sorted(now) == ["gang-g0-r0", "gang-g0-r1"], sorted(now)
        _steady(kube, ns, "gang", 5, one_restart)
    finally:
        let.stop()
    assert not let.errors, let.errors


def test_died_mid_drain_the_drain_is_followed_and_reported_once(world, control_plane, kube, core):
    ns, start = world
    body = create_ie(kube, engine("dr", ns).groups(2).drain(60).manifest())
    Reconciler(Kube(control_plane.api_client())).reconcile(body)
    let = kubelet.Kubelet(core, ns, "dr")
    let.start()
    try:
        wait_for(lambda: len([p for p in pods(kube, ns, "dr").values()
                              if p["spec"].get("nodeName")]) == 2, timeout=10, what="bound")
        Reconciler(Kube(control_plane.api_client())).reconcile(body)
        assert _status(kube, ns, "dr").get("readyReplicas") == 2
        let.pause()  # rank 0 of group 1 keeps draining while the operator is dead
        kube.patch("shoal.dev/v1alpha1", "inferenceengines", ns, "dr", {"spec": {"replicas": 1}})
        body = ie(kube, ns, "dr")
        _pass_dies(control_plane, body,
                   lambda verb, plural, name: (verb, name) == ("delete", "dr-g1-r0"))
        assert pods(kube, ns, "dr")["dr-g1-r0"]["metadata"].get("deletionTimestamp")
        assert not events(kube, ns, "DrainStarted"), "died before its Event"

        start()
        wait_for(lambda: len(events(kube, ns, "DrainStarted")) == 1, timeout=20,
                 what="the drain adopted by the new operator")
        wait_for(lambda: any(g["index"] == 1 and g["phase"] == "Draining"
                             and g.get("drainStartTime")
                             for g in _status(kube, ns, "dr").get("groups") or []),
                 timeout=10, what="group 1 Draining in status (the pass writes it after Events)")
        let.resume()  # the engine finishes its drain
        wait_for(lambda: len(events(kube, ns, "DrainFinished")) == 1, timeout=30,
                 what="the drain reported finished")
        _ready(kube, ns, "dr", 1)

        def drained_once(st, now):
            assert sorted(now) == ["dr-g0-r0"] and st.get("restartCount", 0) == 0, (st, now)
            assert len(events(kube, ns, "DrainStarted")) == 1
            assert len(events(kube, ns, "DrainFinished")) == 1
        _steady(kube, ns, "dr", 4, drained_once)
    finally:
        let.stop()


def test_died_mid_rollout_the_rollout_finishes_one_group_at_a_time(world, control_plane, kube,
                                                                   core):
    ns, start = world
    body = create_ie(kube, engine("roll", ns).groups(2).drain(30).manifest())
    Reconciler(Kube(control_plane.api_client())).reconcile(body)
    let = kubelet.Kubelet(core, ns, "roll")
    let.start()
    try:
        wait_for(lambda: len([p for p in pods(kube, ns, "roll").values()
                              if p["spec"].get("nodeName")]) == 2, timeout=10, what="bound")
        Reconciler(Kube(control_plane.api_client())).reconcile(body)
        old_rev = _status(kube, ns, "roll")["groups"][0]["revision"]
        let.pause()
        kube.patch("shoal.dev/v1alpha1", "inferenceengines", ns, "roll",
                   {"spec": {"engine": {"extraArgs": ["--max-num-seqs", "8"]}}})
        body = ie(kube, ns, "roll")
        _pass_dies(control_plane, body,
                   lambda verb, plural, name: (verb, plural) == ("delete", "pods"))
        stopping = [n for n, p in pods(kube, ns, "roll").items()
                    if p["metadata"].get("deletionTimestamp")]
        assert stopping == ["roll-g0-r0"], stopping

        start()
        let.resume()

        def rolled():
            st, now = _status(kube, ns, "roll"), pods(kube, ns, "roll")
            revs = {g.get("revision") for g in st.get("groups") or []}
            return (st.get("readyReplicas") == 2 and len(now) == 2 and old_rev not in revs
                    and len(revs) == 1)
        wait_for(rolled, timeout=60, what="both groups at the new revision")

        def done(st, now):
            assert sorted(now) == ["roll-g0-r0", "roll-g1-r0"] and st.get("restartCount", 0) == 0
        _steady(kube, ns, "roll", 3, done)
        updates = [e["message"] for e in events(kube, ns, "GroupUpdating")]
        assert sorted(m.split(":")[0] for m in updates) == ["group 0", "group 1"], \
            "each group rolled once"
    finally:
        let.stop()


def test_died_between_creating_rank_0_and_rank_1_the_group_is_completed(world, control_plane,
                                                                        kube, core):
    ns, start = world
    body = create_ie(kube, engine("half", ns).ranks(2).manifest())
    done = _pass_dies(control_plane, body,
                      lambda verb, plural, name: (verb, plural) == ("create", "pods"))
    assert [d[2] for d in done if d[:2] == ("create", "pods")] == ["half-g0-r0"]
    assert sorted(pods(kube, ns, "half")) == ["half-g0-r0"]
    uid0 = pods(kube, ns, "half")["half-g0-r0"]["metadata"]["uid"]

    start()
    let = kubelet.Kubelet(core, ns, "half")
    let.start()
    try:
        _ready(kube, ns, "half", 1)
        now = pods(kube, ns, "half")
        assert sorted(now) == ["half-g0-r0", "half-g0-r1"]
        assert now["half-g0-r0"]["metadata"]["uid"] == uid0, "rank 0 kept, only rank 1 added"
        assert _status(kube, ns, "half").get("restartCount", 0) == 0
    finally:
        let.stop()
