"""InferenceEngines and their children on the API server, read and written through the
operator's own dict client (`shoal.operator.kube.Kube`): short names for what tests ask."""

from __future__ import annotations

from kubernetes.client.exceptions import ApiException
from shoal.operator import labels as L
from shoal.operator.kube import Kube


def ie(kube: Kube, ns: str, name: str) -> dict | None:
    return kube.get(L.API_VERSION, L.PLURAL, ns, name)


def pods(kube: Kube, ns: str, name: str, group: int | None = None) -> dict[str, dict]:
    """The engine pods of one InferenceEngine (or one of its groups), by pod name."""
    sel = f"{L.LABEL_ENGINE}={name},{L.LABEL_COMPONENT}={L.COMPONENT_ENGINE}"
    if group is not None:
        sel += f",{L.LABEL_GROUP}={group}"
    return {p["metadata"]["name"]: p for p in kube.list("v1", "pods", ns, sel)}


def create_ie(kube: Kube, body: dict) -> dict:
    ns = body["metadata"]["namespace"]
    return kube.request("POST", f"/apis/{L.API_VERSION}/namespaces/{ns}/{L.PLURAL}", body=body)


def events(kube: Kube, ns: str, reason: str | None = None) -> list[dict]:
    evs = kube.list("v1", "events", ns)
    return [e for e in evs if reason is None or e.get("reason") == reason]


def condition(body: dict | None, type_: str) -> dict:
    for c in ((body or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return c
    return {}


def api_error(fn) -> ApiException:
    try:
        fn()
    except ApiException as e:
        return e
    raise AssertionError("expected the API server to reject the request")


def cleanup_namespace(kube: Kube, ns: str) -> None:
    """Leave nothing that keeps an operator busy: delete the InferenceEngines without waiting
    for their ordered shutdown (no kubelet will finish bound pods), force-delete the engine
    pods, then delete the namespace."""
    for obj in kube.list(L.API_VERSION, L.PLURAL, ns):
        name = obj["metadata"]["name"]
        kube.delete(L.API_VERSION, L.PLURAL, ns, name)
        kube.patch(L.API_VERSION, L.PLURAL, ns, name, {"metadata": {"finalizers": None}})
    for pod in kube.list("v1", "pods", ns, f"{L.LABEL_COMPONENT}={L.COMPONENT_ENGINE}"):
        kube.delete("v1", "pods", ns, pod["metadata"]["name"], grace_seconds=0)
    kube.delete("v1", "namespaces", None, ns)
