"""What the running operator holds between handler calls: the reconciler, the pod and adapter
indices it reads, the drain probes, the adapter sync, the planned wake-ups, the waiters of
delete handlers and the stats file. One `OperatorState` is made by the startup handler and kept
in kopf's root `memo` (`memo.shoal`); kopf gives every resource handler a shallow copy of that
memo, so all of them reach the same object, and nothing lives in module globals.

`run_pass` is the one way a pass runs in the operator (handlers, wake-ups, drain probes): after
each pass it plans the next look, follows the drain probes, wakes a delete handler whose
resource has no engine pod left, and writes the stats file when asked.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field

from shoal.operator import adapter_pass, node_index, pod_index, settings
from shoal.operator.adapter_sync import AdapterSync
from shoal.operator.drain_probe import DrainProbes
from shoal.operator.kube import Kube
from shoal.operator.metrics import OperatorMetrics
from shoal.operator.observed import iso
from shoal.operator.reconcile import Outcome, Reconciler, listed_pods
from shoal.operator.wakeups import Wakeups

log = logging.getLogger("shoal.operator")

STATS_ENV = "SHOAL_OPERATOR_STATS_FILE"  # where the benchmark wants the API call counts
STATS_EVERY_SECONDS = 1.0


class StatsFile:
    """Where asked ($SHOAL_OPERATOR_STATS_FILE), the read and write counts of the operator's
    client, for the benchmark: after passes (at most once a second) and at exit."""

    def __init__(self, kube: Kube, path: str | None):
        self.kube, self.path = kube, path
        self._lock = threading.Lock()  # handlers run in a thread pool
        self._at = 0.0

    def maybe_write(self) -> None:
        if self.path and time.monotonic() - self._at > STATS_EVERY_SECONDS:
            self.write()

    def write(self) -> None:
        if not self.path:
            return
        with self._lock:
            counts = {kind: {f"{verb} {plural}": n for (verb, plural), n in sorted(c.items())}
                      for kind, c in (("writes", self.kube.writes), ("reads", self.kube.reads))}
            try:
                with open(self.path + ".tmp", "w") as f:
                    json.dump(counts, f)
                os.replace(self.path + ".tmp", self.path)
            except OSError as e:  # a report, never a reason to fail a handler
                log.warning("could not write %s: %s", self.path, e)
            self._at = time.monotonic()


@dataclass
class StopWaiter:
    """A delete handler waiting for its resource's last engine pod to go."""

    loop: asyncio.AbstractEventLoop
    event: asyncio.Event = field(default_factory=asyncio.Event)

    def set(self) -> None:  # from any thread
        self.loop.call_soon_threadsafe(self.event.set)


def server_version_info(kube: Kube) -> dict | None:
    """The API server's /version, read once at start (None, logged, when it cannot be read:
    the settings then choose what every server runs)."""
    try:
        return kube.request("GET", "/version")
    except Exception as e:  # noqa: BLE001
        log.warning("could not read the API server's version: %s", e)
        return None


class OperatorState:
    def __init__(self, kube: Kube, metrics: OperatorMetrics | None = None):
        self.pods = pod_index.PodIndex(listed_pods(kube))
        self.nodes = node_index.NodeIndex(node_index.listed_node(kube))
        self.node_changes = node_index.ReadyChanges()
        self.drain_probes = DrainProbes(on_change=lambda key: self.wakeups.schedule(key, 0))
        self.adapter_sync = AdapterSync(on_change=lambda key: self.wakeups.schedule(key, 0))
        self.adapters = adapter_pass.AdapterIndex(adapter_pass.listed_adapters(kube))
        self.wakeups = Wakeups(lambda key: self.run_pass(
            {"metadata": {"namespace": key[0], "name": key[1]}}))
        self.settings = settings.from_env(server_version_info(kube))
        self.reconciler = Reconciler(kube, pods=self.pods, in_flight=self.drain_probes.counts,
                                     settings=self.settings, adapters=self.adapters,
                                     adapter_sync=self.adapter_sync, nodes=self.nodes,
                                     metrics=metrics)
        self.stats = StatsFile(kube, os.environ.get(STATS_ENV))
        self._stop_waiters: dict[str, StopWaiter] = {}  # uid -> its delete handler's waiter
        self._waiters_lock = threading.Lock()

    def attach(self, handler_kwargs: dict) -> None:
        """Hand kopf's indices to the reconciler (kopf passes indices to handlers only)."""
        if handler_kwargs.get(pod_index.INDEX) is not None:
            self.pods.attach(handler_kwargs[pod_index.INDEX])
        if handler_kwargs.get(adapter_pass.INDEX) is not None:
            self.adapters.attach(handler_kwargs[adapter_pass.INDEX])
        if handler_kwargs.get(node_index.INDEX) is not None:
            self.nodes.attach(handler_kwargs[node_index.INDEX])

    def on_node(self, name: str, health, pods_index) -> None:
        """A node's Ready condition changed (or the node went): a pass, now, for every engine
        with a pod there; the pass plans its next look at the node-loss deadline."""
        if not self.node_changes.changed(name, health):
            return
        engines = node_index.engines_on(pods_index, name)
        state = "gone" if health is None else f"Ready={health.ready} ({health.reason or '-'})"
        log.info("node %s %s: %d engine(s) with pods there: %s", name, state, len(engines),
                 ", ".join(f"{ns}/{n}" for ns, n in sorted(engines)) or "-")
        for namespace, engine in sorted(engines):
            self.wakeups.schedule((namespace, engine), 0)

    def run_pass(self, body: dict) -> Outcome:
        outcome = self.reconciler.reconcile(body)
        meta = body["metadata"]
        key = (meta["namespace"], meta["name"])
        if outcome.requeue_after is not None:
            self.wakeups.schedule(key, outcome.requeue_after)
        self.drain_probes.follow(*key, outcome.drain_probes)
        if outcome.stopped:
            with self._waiters_lock:
                waiter = self._stop_waiters.get(outcome.uid)
            if waiter is not None:
                waiter.set()
        self.stats.maybe_write()
        return outcome

    def adapter_engine_missing(self, adapter) -> None:
        self.reconciler.adapters.engine_missing(adapter, iso(self.reconciler.clock()))

    def stop_waiter(self, uid: str) -> StopWaiter:
        """Register (before the handler's first pass, so no pass is missed) the event that the
        pass seeing no engine pod of this resource left sets."""
        waiter = StopWaiter(asyncio.get_running_loop())
        with self._waiters_lock:
            self._stop_waiters[uid] = waiter
        return waiter

    def forget_stop_waiter(self, uid: str) -> None:
        with self._waiters_lock:
            self._stop_waiters.pop(uid, None)
