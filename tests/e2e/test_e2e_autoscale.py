"""The operator's own autoscaler on real pods (issue 28): load rises and the groups go 1 -> 3;
lighter load and the removed groups drain with streams in flight (each one finishes); idle and
the engine goes to zero while its frontend stays; a request at zero is held by the frontend,
which renews the wake Lease through the API with its own ServiceAccount (RBAC enforced), and is
answered once the operator's new group is Ready. The first token's latency at zero is measured
with its breakdown (decision, pod scheduled, container started, Ready, answered)."""

from __future__ import annotations

import threading
import time

import pytest
from support.wait import wait_for

from e2e.e2e_helpers import (
    MODEL,
    Stream,
    client,
    condition_time,
    create,
    events,
    iso_seconds,
    pods,
    record,
    service_url,
    status,
    wait_ready,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
NAME = "auto"
ENGINE = f"shoal.dev/engine={NAME},shoal.dev/component=engine"
AUTOSCALING = {"minReplicas": 0, "maxReplicas": 3, "requestsPerGroup": 2,
               "scaleUpStabilizationSeconds": 5, "scaleDownDelaySeconds": 20}


class Load:
    """`n` streams always in flight (each re-issued when it ends) until stopped; every stream
    it ever ran is kept, so the test can say that none was lost."""

    def __init__(self, url: str, n: int, max_tokens: int) -> None:
        self.url, self.n, self.max_tokens = url, n, max_tokens
        self.done: list[Stream] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(n)]
        for t in self._threads:
            t.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            s = Stream(self.url, max_tokens=self.max_tokens)
            s.start()
            s.join(300)
            self.done.append(s)

    def stop(self) -> list[Stream]:
        self._stop.set()
        for t in self._threads:
            t.join(300)
        return self.done


def _assert_none_lost(streams: list[Stream]) -> None:
    bad = [(s.finish_reason, s.error, s.chunks) for s in streams
           if s.error is not None or s.finish_reason != "length"]
    assert streams and not bad, f"{len(bad)} of {len(streams)} streams lost: {bad[:5]}"


def _desired(cluster, ns) -> int | None:
    return (status(cluster, ns, NAME).get("autoscaling") or {}).get("desiredGroups")


def test_load_scales_up_then_down_to_zero_and_a_request_at_zero_is_answered(cluster, new_ns):
    ns = new_ns("e2e-auto")
    create(cluster, ns, NAME, replicas=1, shutdown_s=30, autoscaling=AUTOSCALING)
    wait_ready(cluster, ns, NAME, "1/1")
    url = service_url(cluster, ns, NAME)
    assert client(url).completions.create(model=MODEL, prompt="hi", max_tokens=4).choices

    # Load rises: 6 streams always in flight over 1 group is 6 per group, target 2 -> 3 groups.
    t0 = time.monotonic()
    heavy = Load(url, 6, max_tokens=400)
    wait_for(lambda: _desired(cluster, ns) == 3, timeout=120, interval=1, what="desired 3")
    ups = sorted(events(cluster, ns, "ScaledUp", NAME), key=lambda e: e["firstTimestamp"])
    assert ups[0]["message"].startswith("1 -> ") and all(
        "requestsPerGroup" in e["message"] for e in ups), [e["message"] for e in ups]
    wait_ready(cluster, ns, NAME, "3/3", timeout=300)
    record("autoscale_1_to_3_ready", time.monotonic() - t0)
    streams = heavy.stop()

    # Lighter load: 2 streams over 3 groups -> 1 group after the 20 s delay; groups 1 and 2
    # drain while streams run on them, and every stream finishes.
    t1 = time.monotonic()
    light = Load(url, 2, max_tokens=300)
    wait_for(lambda: _desired(cluster, ns) == 1, timeout=150, interval=1, what="desired 1")
    wait_for(lambda: {p["metadata"]["labels"]["shoal.dev/group"]
                      for p in pods(cluster, ns, ENGINE)} == {"0"},
             timeout=180, interval=1, what="groups 1 and 2 drained and gone")
    record("autoscale_3_to_1_drained", time.monotonic() - t1)
    streams += light.stop()
    _assert_none_lost(streams)
    drained = events(cluster, ns, "DrainStarted", NAME)
    assert len(drained) >= 1, "the removed groups drained"

    # Idle: to zero after the delay; the frontend stays Ready and the Service keeps answering.
    t2 = time.monotonic()
    wait_for(lambda: _desired(cluster, ns) == 0, timeout=150, interval=1, what="desired 0")
    wait_for(lambda: not pods(cluster, ns, ENGINE), timeout=120, interval=1,
             what="every engine pod gone")
    record("autoscale_idle_to_zero", time.monotonic() - t2)
    (front,) = pods(cluster, ns, f"shoal.dev/engine={NAME},shoal.dev/component=frontend")
    assert condition_time(front, "Ready") is not None, "the frontend stays Ready at zero"
    lease = cluster.get("lease", f"{NAME}-wake", "-n", ns)
    assert not (lease.get("spec") or {}).get("renewTime"), "nothing asked for a group yet"

    # A request at zero (a stream and a plain completion): held, the Lease renewed, answered.
    sent = time.time()
    at_zero = Stream(url, max_tokens=16)
    at_zero.start()
    plain = client(url, timeout=200).completions.create(model=MODEL, prompt="def f(x):",
                                                        max_tokens=8, temperature=0)
    answered = time.time()
    assert plain.usage.completion_tokens == 8
    at_zero.join(200)
    _assert_none_lost([at_zero])
    lease = cluster.get("lease", f"{NAME}-wake", "-n", ns)
    assert lease["spec"]["holderIdentity"] == front["metadata"]["name"], lease["spec"]
    ups = events(cluster, ns, "ScaledUp", NAME)
    woke = [e for e in ups if "wake requested" in e["message"]]
    assert woke and woke[-1]["message"].startswith("0 -> 1 groups"), [e["message"] for e in ups]
    (pod,) = pods(cluster, ns, ENGINE)
    started = (pod["status"]["containerStatuses"][0]["state"].get("running") or {})
    breakdown = {
        "decision": iso_seconds(woke[-1].get("lastTimestamp") or woke[-1].get("firstTimestamp")),
        "pod_created": iso_seconds(pod["metadata"]["creationTimestamp"]),
        "pod_scheduled": condition_time(pod, "PodScheduled"),
        "container_started": iso_seconds(started.get("startedAt")),
        "ready": condition_time(pod, "Ready"),
    }
    steps = {k: round(v - sent, 1) for k, v in breakdown.items() if v is not None}
    record("autoscale_request_at_zero_answered", answered - sent, **steps)
    assert answered - sent < 180
    assert status(cluster, ns, NAME)["autoscaling"]["desiredGroups"] == 1
    wait_ready(cluster, ns, NAME, "1/1", timeout=60)
