"""Waking an engine at zero on the real API server: the router's LeaseWaker renews the wake
Lease (its renewTime and holder as the API server stores them), and names a missing Lease."""

from __future__ import annotations

import datetime as dt

import pytest
from kubernetes import client
from shoal.contract import discovery
from shoal.router.k8s_wake import LeaseWaker, micro_time

pytestmark = pytest.mark.k8s


def test_micro_time_is_kubernetes_microtime():
    at = dt.datetime(2026, 12, 2, 8, 0, 1, 250000, tzinfo=dt.timezone.utc)
    assert micro_time(at) == "2026-12-02T08:00:01.250000Z"


async def test_the_waker_renews_the_engines_lease(control_plane, tmp_path):
    ns = control_plane.new_namespace("wake")
    lease = discovery.wake_lease_name("chat")
    token = tmp_path / "token"
    token.write_text(control_plane.token)
    with control_plane.api_client() as api:
        leases = client.CoordinationV1Api(api)
        leases.create_namespaced_lease(ns, {"metadata": {"name": lease}, "spec": {}})
        waker = LeaseWaker(control_plane.server, ns, "chat-frontend-abc", token_file=token,
                           ca_file=control_plane.ca_file)
        before = dt.datetime.now(dt.timezone.utc)
        await waker("chat")
        got = leases.read_namespaced_lease(lease, ns).spec
        assert got.holder_identity == "chat-frontend-abc"
        assert got.renew_time >= before - dt.timedelta(seconds=1)
        await waker(f"{ns}/chat")  # the gateway's name for it
        with pytest.raises(RuntimeError, match=rf"PATCH Lease {ns}/other-wake: HTTP 404"):
            await waker("other")
        client.CoreV1Api(api).delete_namespace(ns)
