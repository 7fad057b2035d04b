"""Ordered stop of one engine group, planned: rank 0 drains first, its headless ranks stay up
until it is gone (they are needed for every forward pass), then they stop. Timeout 0, or a dead
engine, stops every rank at once. Progress and outcome are Events; the group leaves the
discovery file before rank 0 is asked to stop admitting.

Pure: each step appends actions to the pass (`PassState.act`), nothing here calls the API.
"""

from __future__ import annotations

import datetime as dt

from shoal.operator.actions import DeletePod, WriteDiscovery
from shoal.operator.events import NORMAL, WARNING
from shoal.operator.failures import is_stopping, root_cause, terminated_state
from shoal.operator.observed import PassState, iso, metrics_url, parse_time
from shoal.operator.phases import GroupPhase
from shoal.operator.render_common import SHUTDOWN_MARGIN_SECONDS

# A dead group's live ranks get SIGTERM and this long before SIGKILL (not their drain grace:
# there is nothing left to drain).
DEAD_GROUP_GRACE_SECONDS = 10
# A pod still there this long after its grace ran out is on a node that does not answer: its
# object is removed (grace 0) so that the group can come back elsewhere.
FORCE_AFTER_SECONDS = 30


def rank0_finished(pod: dict) -> bool:
    """Rank 0 was asked to stop and its engine container has terminated: the drain is over
    even though the kubelet may keep the pod object for a while (found on a real cluster:
    the engine exited at +6.6 s, the pod object went at +35 s)."""
    return is_stopping(pod) and terminated_state(pod) is not None


def drain_started(pod: dict) -> dt.datetime | None:
    """When a stopping pod was asked to stop: its deletionTimestamp is that moment plus its
    grace period."""
    gone_at = parse_time(pod["metadata"].get("deletionTimestamp"))
    grace = pod["metadata"].get("deletionGracePeriodSeconds")
    return gone_at - dt.timedelta(seconds=int(grace)) if gone_at and grace is not None else None


def teardown(st: PassState, pods: dict[int, dict], grace: int | None) -> None:
    """Delete these pods; one already stopping is left alone, unless it must now go faster.
    A pod on a lost node goes with grace 0 (its kubelet will never confirm a graceful stop)."""
    for _, p in sorted(pods.items()):
        if p["metadata"].get("uid") in st.forced:
            continue
        this = 0 if st.lost(p) else grace
        current = p["metadata"].get("deletionGracePeriodSeconds")
        if not is_stopping(p) or (this is not None and (current is None or current > this)):
            st.act(DeletePod(p["metadata"]["name"], p["metadata"].get("uid"), this))
            if this == 0:
                st.forced.add(p["metadata"].get("uid"))


def force_lost(st: PassState, pods: dict[int, dict]) -> None:
    """Pods already stopping (a drain, an eviction) on a node lost by now: removed with grace 0,
    whatever their group is doing, since nothing else ever removes them."""
    teardown(st, {r: p for r, p in pods.items() if is_stopping(p) and st.lost(p)}, grace=0)


def teardown_dead(st: PassState, pods: dict[int, dict]) -> None:
    """Stop a dead group's ranks so that no replacement of the same name can start while an
    old process still runs: SIGTERM with DEAD_GROUP_GRACE_SECONDS, the pod object staying
    until the kubelet saw its container stop (the replacement waits for the object to go).
    Grace 0 only where nothing runs any more (the container terminated) or where the grace
    ran out FORCE_AFTER_SECONDS ago (a node that no longer answers)."""
    for r, p in sorted(pods.items()):
        gone_at = parse_time(p["metadata"].get("deletionTimestamp"))
        force_at = gone_at + dt.timedelta(seconds=FORCE_AFTER_SECONDS) if gone_at else None
        overdue = force_at is not None and st.now >= force_at
        ended = terminated_state(p) is not None
        teardown(st, {r: p}, grace=0 if ended or overdue else DEAD_GROUP_GRACE_SECONDS)
        if gone_at is not None and not (ended or overdue or st.lost(p)):
            st.requeue((force_at - st.now).total_seconds())


def stop(st: PassState, g: int, mem: dict, pods: dict[int, dict], reason: str) -> dict | None:
    """The group's next state after one step of its stop; None once a removed group is gone."""
    mem = {**mem, "index": g}
    if not pods:
        if mem.get("drainStartTime"):
            _drain_done(st, g, mem)
        return None if reason in ("scale-down", "delete") else mem
    timeout = st.spec.shutdown_timeout_seconds
    mem.update(phase=GroupPhase.UPDATING if reason == "update" else GroupPhase.DRAINING,
               stopReason=reason)
    rank0 = pods.get(0)
    # Once rank 0 drains, its headless ranks exiting is part of the stop: node 0 tells them
    # to stop when its engine ends (found on real pods: rank 1 exited before the kubelet
    # reported rank 0's end, and the drain was misreported as a dead engine).
    draining = rank0 is not None and is_stopping(rank0) or bool(mem.get("drainStartTime"))
    dead = None if draining else root_cause(list(pods.values()))
    if timeout == 0 or dead is not None:
        if not all(is_stopping(p) for p in pods.values()):
            st.event(NORMAL, "GroupAborted",
                     f"group {g}: stopping all {len(pods)} ranks at once ({reason}, "
                     + ("shutdown.timeoutSeconds is 0)" if timeout == 0 else "the engine is dead)"))
        teardown(st, {r: p for r, p in pods.items() if not is_stopping(p)}, grace=None)
        mem["message"] = f"aborting ({reason})"
        return mem
    if rank0 is not None and not rank0_finished(rank0):
        if not is_stopping(rank0):
            if not st.deleting:  # frontends stop sending before rank 0 stops admitting
                st.serving.discard(g)
                st.act(WriteDiscovery(tuple(sorted(st.serving))))
            st.act(DeletePod(rank0["metadata"]["name"], rank0["metadata"].get("uid"), None))
            mem["drainStartTime"] = iso(st.now)
            st.event(
                NORMAL,
                "DrainStarted",
                f"group {g}: rank 0 pod {rank0['metadata']['name']} draining for up to "
                f"{timeout}s ({reason}); {len(pods) - 1} headless ranks stay up until it finishes",
            )
        elif not mem.get("drainStartTime"):
            # A drain this pass did not start and status does not know (an operator that died
            # between the delete and its status write): adopted from the pod, so its end is
            # still reported and its deadline kept.
            mem["drainStartTime"] = iso(drain_started(rank0) or st.now)
            st.event(NORMAL, "DrainStarted",
                     f"group {g}: rank 0 pod {rank0['metadata']['name']} draining since "
                     f"{mem['drainStartTime']} ({reason}; found stopping: the pass that asked "
                     "did not record it)")
        # No elapsed seconds here: the status changes when the drain starts and ends, not
        # every pass. Rank 0's container ending is a pod event; the deadline is a wake-up.
        started = parse_time(mem.get("drainStartTime")) or st.now
        mem["message"] = f"rank 0 draining ({reason}) for up to {timeout}s since {iso(started)}"
        if (url := metrics_url(rank0)) is not None:
            st.drain_probes[g] = url
        if (n := st.in_flight.get(g)) is not None:  # the last count read from rank 0's /metrics
            requests = f"{n} request{'s' if n != 1 else ''}"
            mem["message"] = f"draining: {requests} in flight; " + mem["message"]
        deadline = started + dt.timedelta(seconds=timeout + SHUTDOWN_MARGIN_SECONDS)
        st.requeue(max((deadline - st.now).total_seconds(), 2.0))
        return mem
    # Rank 0's engine has ended (its container terminated, or its pod is gone): the drain is
    # over, and its headless ranks have nothing left to serve.
    if mem.get("drainStartTime"):
        _drain_done(st, g, mem)
    teardown(st, {r: p for r, p in pods.items() if r != 0 and not is_stopping(p)}, grace=None)
    left = len(pods)
    mem["message"] = (f"rank 0 finished ({reason}); waiting for {left} pod"
                      f"{'s' if left != 1 else ''} to go")
    return mem


def _drain_done(st: PassState, g: int, mem: dict) -> None:
    timeout = st.spec.shutdown_timeout_seconds
    took = (st.now - (parse_time(mem.pop("drainStartTime")) or st.now)).total_seconds()
    if took <= timeout + SHUTDOWN_MARGIN_SECONDS:
        st.event(NORMAL, "DrainFinished",
                 f"group {g}: rank 0 finished draining in {took:.0f}s (limit {timeout}s)")
    else:
        st.event(WARNING, "DrainOverdue",
                 f"group {g}: rank 0 took {took:.0f}s, past its {timeout}s drain limit")
