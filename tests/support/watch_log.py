"""Every watch event of one collection, with the time it arrived, in a thread: what tests and
benchmarks count (how often an object was written) or order (which pod stopped first) without
polling past a change.

    log = WatchLog.pods(api_client, ns); log.start(); ...; log.stop()
    log.writes(name, since=t)   -> {"status": n, "metadata": m}
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass


@dataclass
class Event:
    at: float  # time.monotonic() when it arrived
    type: str  # ADDED | MODIFIED | DELETED
    obj: dict


class WatchLog(threading.Thread):
    def __init__(self, list_fn, *args, **kwargs) -> None:
        super().__init__(daemon=True)
        self._list = (list_fn, args, kwargs)
        self.events: list[Event] = []
        self.ready = threading.Event()
        self._watch = None

    @classmethod
    def pods(cls, api_client, ns: str, label_selector: str = "") -> WatchLog:
        from kubernetes import client

        core = client.CoreV1Api(api_client)
        return cls(core.list_namespaced_pod, ns, label_selector=label_selector)

    @classmethod
    def custom(cls, api_client, group: str, version: str, ns: str, plural: str) -> WatchLog:
        from kubernetes import client

        return cls(client.CustomObjectsApi(api_client).list_namespaced_custom_object,
                   group, version, ns, plural)

    def run(self) -> None:
        from kubernetes import watch

        fn, args, kwargs = self._list
        self._watch = watch.Watch()
        serialize = fn.__self__.api_client.sanitize_for_serialization
        self.ready.set()
        try:
            for ev in self._watch.stream(fn, *args, timeout_seconds=3600, **kwargs):
                obj = ev["object"]
                self.events.append(Event(time.monotonic(), ev["type"],
                                         obj if isinstance(obj, dict) else serialize(obj)))
        except Exception:  # noqa: BLE001 - the server or the test went away under the watch
            pass

    def start(self) -> WatchLog:
        super().start()
        self.ready.wait(30)
        time.sleep(0.5)  # the watch request is sent after `ready`: let it reach the server
        return self

    def stop(self) -> None:
        if self._watch is not None:
            self._watch.stop()

    def of(self, name: str) -> list[Event]:
        return [e for e in self.events if e.obj["metadata"]["name"] == name]

    def writes(self, name: str, since: float = 0.0, until: float = float("inf")) -> dict[str, int]:
        """Writes to `name` between two times: those that changed its status, and those that
        changed its metadata (annotations, finalizers, labels)."""
        counts = {"status": 0, "metadata": 0}
        prev = None
        for e in self.of(name):
            if prev is not None and e.type == "MODIFIED" and since <= e.at <= until:
                pm, m = prev["metadata"], e.obj["metadata"]
                if prev.get("status") != e.obj.get("status"):
                    counts["status"] += 1
                if any(pm.get(k) != m.get(k) for k in ("annotations", "finalizers", "labels")):
                    counts["metadata"] += 1
            prev = e.obj
        return counts
