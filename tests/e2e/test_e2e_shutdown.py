"""Scale-down and delete with streams in flight, on real pods: with shutdown.timeoutSeconds > 0
the streams finish and no new request reaches the draining group; with 0 they end with `abort`.
"""

from __future__ import annotations

import time

import pytest
from support.wait import wait_for
from support.watch_log import WatchLog

from e2e.e2e_helpers import (
    Stream,
    completes,
    create,
    events,
    frontend_metrics,
    group_metric,
    pods,
    record,
    service_url,
    wait_ready,
    wait_serving,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


def _streams(url: str, n: int, max_tokens: int) -> list[Stream]:
    out = [Stream(url, max_tokens=max_tokens) for _ in range(n)]
    for s in out:
        s.start()
    for s in out:
        assert s.started_tokens.wait(120), "a stream produced no token"
        assert s.error is None, s.error
    return out


def _children_gone(cluster, ns: str, name: str) -> bool:
    left = cluster.kubectl("get", "pods,deploy,svc,cm,pdb,sa,role,rolebinding", "-n", ns, "-l",
                           f"shoal.dev/engine={name}", "-o", "name", check=False).stdout.split()
    return not left


def test_scale_down_drains_then_delete_drains(cluster, new_ns):
    ns = new_ns("e2e-drain")
    name = "drain"
    create(cluster, ns, name, replicas=2, shutdown_s=120, max_model_len=2048)
    wait_ready(cluster, ns, name, "2/2")
    url = service_url(cluster, ns, name)
    wait_serving(url)

    # Streams long enough to outlive the scale-down's first steps (ignore_eos: all max_tokens;
    # max_model_len 2048).
    streams = _streams(url, 4, max_tokens=1000)
    m = frontend_metrics(cluster, ns, name)
    on_g1 = group_metric(m, "shoal_router_outstanding_requests", 1)
    done_g1 = group_metric(m, "shoal_router_requests_total", 1)
    assert on_g1 >= 1, f"no stream went to group 1: {m}"

    cluster.kubectl("scale", "ie", name, "-n", ns, "--replicas=1")
    t_scale = time.monotonic()
    wait_for(lambda: events(cluster, ns, "DrainStarted"), timeout=60, what="DrainStarted")
    # While group 1 drains, new requests go to group 0 only.
    for _ in range(4):
        assert completes(url)
    for s in streams:
        s.join(300)
    assert [s.finish_reason for s in streams] == ["length"] * 4, \
        [(s.finish_reason, s.error) for s in streams]
    wait_for(lambda: not pods(cluster, ns, f"shoal.dev/engine={name},shoal.dev/group=1"),
             timeout=120, what="group 1's pods gone")
    wait_for(lambda: events(cluster, ns, "DrainFinished"), timeout=60, what="DrainFinished")
    record("scale_down_drain", time.monotonic() - t_scale, streams=4)
    m = frontend_metrics(cluster, ns, name)
    assert group_metric(m, "shoal_router_requests_total", 1) == done_g1 + on_g1, \
        "a request reached group 1 after it left discovery"
    assert group_metric(m, "shoal_router_upstream_errors_total", 1) == 0, m

    # Delete with streams in flight: they finish, then everything is garbage-collected. Every
    # write to the resource is counted (found on a real cluster: a 14 s delete made 17 status
    # and 29 annotation patches, the message carried elapsed seconds and kopf retried each 1 s).
    writes = WatchLog.custom(cluster.api_client(), "shoal.dev", "v1alpha1", ns,
                             "inferenceengines").start()
    streams = _streams(url, 2, max_tokens=800)
    cluster.kubectl("delete", "ie", name, "-n", ns, "--wait=false")
    t_delete = time.monotonic()
    for s in streams:
        s.join(300)
    assert [s.finish_reason for s in streams] == ["length"] * 2, \
        [(s.finish_reason, s.error) for s in streams]
    wait_for(lambda: _children_gone(cluster, ns, name), timeout=180, interval=0.5,
             what="every child gone")
    took = time.monotonic() - t_delete
    writes.stop()
    w = writes.writes(name, since=t_delete)
    record("delete_to_gone", took, streams=2, drain=True, status_writes=w["status"],
           metadata_writes=w["metadata"])
    # One drain per group, each reported once, on scale-down and on delete alike.
    assert len(events(cluster, ns, "DrainStarted", name)) == 2
    assert len(events(cluster, ns, "DrainFinished", name)) == 2, \
        events(cluster, ns, "DrainFinished")
    assert not events(cluster, ns, "DrainOverdue", name)
    # Status: Terminating, rank 0 stopping, rank 0 finished, the group gone (a few more as the
    # kubelet reports the pod); metadata: kopf's finalizer and its bookkeeping, however long the
    # drain (the delete handler follows the whole stop in one run).
    assert w["status"] <= 8, w
    assert w["metadata"] <= 3, (w, took)


def test_timeout_zero_aborts_streams(cluster, new_ns):
    ns = new_ns("e2e-abort")
    name = "abort"
    create(cluster, ns, name, replicas=1, shutdown_s=0, max_model_len=2048)
    wait_ready(cluster, ns, name, "1/1")
    url = service_url(cluster, ns, name)
    wait_serving(url)
    streams = _streams(url, 2, max_tokens=1500)
    cluster.kubectl("delete", "ie", name, "-n", ns, "--wait=false")
    t_delete = time.monotonic()
    for s in streams:
        s.join(120)
    assert all(not s.is_alive() for s in streams)
    assert [s.finish_reason for s in streams] == ["abort"] * 2, \
        [(s.finish_reason, s.chunks, s.error) for s in streams]
    assert all(s.chunks < 1500 for s in streams)
    assert events(cluster, ns, "GroupAborted")
    wait_for(lambda: _children_gone(cluster, ns, name), timeout=180, interval=0.5,
             what="every child gone")
    record("delete_to_gone", time.monotonic() - t_delete, streams=2, drain=False)
