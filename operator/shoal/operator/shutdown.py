"""Ordered stop of one engine group: rank 0 drains first, its headless ranks stay up until it
is gone (they are needed for every forward pass), then they stop. Timeout 0, or a dead engine,
stops every rank at once. Progress and outcome are Events; the group leaves the discovery file
before rank 0 is asked to stop admitting."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable

from shoal.operator import events, render
from shoal.operator.failures import is_stopping, root_cause, terminated_state
from shoal.operator.observed import PassState, iso, parse_time
from shoal.operator.phases import GroupPhase


def rank0_finished(pod: dict) -> bool:
    """Rank 0 was asked to stop and its engine container has terminated: the drain is over
    even though the kubelet may keep the pod object for a while (found on a real cluster:
    the engine exited at +6.6 s, the pod object went at +35 s)."""
    return is_stopping(pod) and terminated_state(pod) is not None


class OrderedStop:
    """Stops one group in rank order. What it acts through is given, not inherited: the API
    client (deletes and Events), `apply` (writes a rendered object, here the discovery
    ConfigMap) and `teardown(st, pods, grace)` (deletes pods)."""

    def __init__(self, kube, apply: Callable[[dict, dict], None],
                 teardown: Callable[[PassState, dict[int, dict], int | None], None]) -> None:
        self.kube = kube
        self._apply = apply
        self._teardown = teardown

    def stop(self, st: PassState, g: int, mem: dict, pods: dict[int, dict], reason: str) -> dict | None:
        """The group's next state after one step of its stop; None once a removed group is gone."""
        mem = {**mem, "index": g}
        if not pods:
            if mem.get("drainStartTime"):
                self._drain_done(st, g, mem)
            return None if reason in ("scale-down", "delete") else mem
        timeout = st.spec.shutdown_timeout_seconds
        mem.update(phase=GroupPhase.UPDATING if reason == "update" else GroupPhase.DRAINING, stopReason=reason)
        rank0 = pods.get(0)
        # Once rank 0 drains, its headless ranks exiting is part of the stop: node 0 tells them
        # to stop when its engine ends (found on real pods: rank 1 exited before the kubelet
        # reported rank 0's end, and the drain was misreported as a dead engine).
        draining = rank0 is not None and is_stopping(rank0) or bool(mem.get("drainStartTime"))
        dead = None if draining else root_cause(list(pods.values()))
        if timeout == 0 or dead is not None:
            if not all(is_stopping(p) for p in pods.values()):
                events.emit(self.kube, st.body, events.NORMAL, "GroupAborted",
                            f"group {g}: stopping all {len(pods)} ranks at once ({reason}, "
                            + ("shutdown.timeoutSeconds is 0)" if timeout == 0 else "the engine is dead)"))
            self._teardown(st, {r: p for r, p in pods.items() if not is_stopping(p)}, grace=None)
            mem["message"] = f"aborting ({reason})"
            return mem
        if rank0 is not None and not rank0_finished(rank0):
            if not is_stopping(rank0):
                self._withdraw(st, g)  # frontends stop sending before rank 0 stops admitting
                self.kube.delete("v1", "pods", rank0["metadata"]["namespace"], rank0["metadata"]["name"],
                                 uid=rank0["metadata"].get("uid"))
                mem["drainStartTime"] = iso(st.now)
                events.emit(self.kube, st.body, events.NORMAL, "DrainStarted",
                            f"group {g}: rank 0 pod {rank0['metadata']['name']} draining for up to "
                            f"{timeout}s ({reason}); {len(pods) - 1} headless ranks stay up until it finishes")
            # No elapsed seconds here: the status changes when the drain starts and ends, not
            # every pass. Rank 0's container ending is a pod event; the deadline is a wake-up.
            started = parse_time(mem.get("drainStartTime")) or st.now
            mem["message"] = f"rank 0 draining ({reason}) for up to {timeout}s since {iso(started)}"
            deadline = started + dt.timedelta(seconds=timeout + render.SHUTDOWN_MARGIN_SECONDS)
            st.requeue(max((deadline - st.now).total_seconds(), 2.0))
            return mem
        # Rank 0's engine has ended (its container terminated, or its pod is gone): the drain is
        # over, and its headless ranks have nothing left to serve.
        if mem.get("drainStartTime"):
            self._drain_done(st, g, mem)
        self._teardown(st, {r: p for r, p in pods.items() if r != 0 and not is_stopping(p)}, grace=None)
        left = len(pods)
        mem["message"] = (f"rank 0 finished ({reason}); waiting for {left} pod"
                          f"{'s' if left != 1 else ''} to go")
        return mem

    def _withdraw(self, st: PassState, g: int) -> None:
        """Rewrite the discovery file without group `g` now, ahead of the end of the pass."""
        if st.deleting:
            return
        st.serving.discard(g)
        self._apply(st.body, render.discovery_configmap(st.body, sorted(st.serving)))

    def _drain_done(self, st: PassState, g: int, mem: dict) -> None:
        timeout = st.spec.shutdown_timeout_seconds
        took = (st.now - (parse_time(mem.pop("drainStartTime")) or st.now)).total_seconds()
        if took <= timeout + render.SHUTDOWN_MARGIN_SECONDS:
            events.emit(self.kube, st.body, events.NORMAL, "DrainFinished",
                        f"group {g}: rank 0 finished draining in {took:.0f}s (limit {timeout}s)")
        else:
            events.emit(self.kube, st.body, events.WARNING, "DrainOverdue",
                        f"group {g}: rank 0 took {took:.0f}s, past its {timeout}s drain limit")
