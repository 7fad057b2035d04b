"""Waking an engine scaled to zero: renew its wake Lease (shoal.contract.discovery
.wake_lease_name) through the API with the pod's ServiceAccount, which may patch only that
Lease (the operator creates it with the engine and watches it). A Lease, not an annotation on
the InferenceEngine: a frontend that may patch its engine could change its spec."""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

from shoal.contract import discovery
from shoal.router.k8s_discovery import SA_DIR, api_client, in_cluster_server

POD_ENV = discovery.POD_ENV


def micro_time(at: dt.datetime) -> str:
    """Kubernetes' MicroTime: RFC 3339 with microseconds, UTC."""
    return at.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def wake_patch(holder: str, at: dt.datetime) -> dict:
    return {"spec": {"holderIdentity": holder, "renewTime": micro_time(at)}}


class LeaseWaker:
    """`await waker(engine)`: renew the wake Lease of `engine` ("NAME" in `namespace`, or
    "NAMESPACE/NAME" as the gateway names engines)."""

    def __init__(self, server: str, namespace: str, holder: str, *,
                 token_file: Path = SA_DIR / "token", ca_file: Path = SA_DIR / "ca.crt") -> None:
        self.server, self.namespace, self.holder = server, namespace, holder
        self.token_file, self.ca_file = token_file, ca_file

    async def __call__(self, engine: str) -> None:
        ns, _, name = engine.rpartition("/")
        ns = ns or self.namespace
        lease = discovery.wake_lease_name(name)
        path = f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/{lease}"
        body = wake_patch(self.holder, dt.datetime.now(dt.timezone.utc))
        async with api_client(self.server, self.token_file, self.ca_file) as client:
            r = await client.patch(path, json=body,
                                   headers={"Content-Type": "application/merge-patch+json"})
        if r.status_code != 200:
            raise RuntimeError(f"PATCH Lease {ns}/{lease}: HTTP {r.status_code} {r.text[:200]}")


def from_environment() -> LeaseWaker | None:
    """The waker of a pod with a ServiceAccount (its namespace, an API server, its pod name);
    None elsewhere."""
    ns, server = os.environ.get(discovery.NAMESPACE_ENV), in_cluster_server()
    if not (ns and server):
        return None
    return LeaseWaker(server, ns, os.environ.get(POD_ENV) or "shoal-router")
