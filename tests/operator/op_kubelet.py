"""Play the kubelet for engine pods, through the same dict client the operator uses.

Small on purpose: bind a pod to a (fake) node so that deletion becomes graceful, report it
running/ready, terminate its engine container with an exit code and a termination message, and
finish a graceful deletion as a kubelet would after the container stopped.
"""

from __future__ import annotations

import datetime as dt

from shoal.operator import labels as L
from shoal.operator.kube import Kube


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _cond(kind: str, ok: bool) -> dict:
    return {"type": kind, "status": "True" if ok else "False", "lastTransitionTime": _now()}


def bind(kube: Kube, ns: str, name: str, node: str = "node-a") -> None:
    """What the scheduler does: a bound pod is deleted gracefully (it waits for its kubelet)."""
    kube.request("POST", f"/api/v1/namespaces/{ns}/pods/{name}/binding",
                 body={"apiVersion": "v1", "kind": "Binding", "metadata": {"name": name},
                       "target": {"apiVersion": "v1", "kind": "Node", "name": node}})


def set_ready(kube: Kube, ns: str, name: str, ready: bool = True,
              container: str = L.ENGINE_CONTAINER) -> None:
    status = {
        "phase": "Running",
        "podIP": "10.244.0.10",
        "conditions": [_cond("Initialized", True), _cond("Ready", ready), _cond("ContainersReady", ready),
                       _cond("PodScheduled", True)],
        "containerStatuses": [{"name": container, "image": "shoal:test", "imageID": "",
                               "ready": ready, "restartCount": 0, "started": True,
                               "state": {"running": {"startedAt": _now()}}}],
    }
    kube.request("PATCH", f"/api/v1/namespaces/{ns}/pods/{name}/status", body={"status": status},
                 content_type="application/merge-patch+json")


def terminate(kube: Kube, ns: str, name: str, exit_code: int = 1, message: str = "",
              reason: str | None = None, signal: int | None = None) -> None:
    term = {"exitCode": exit_code, "reason": reason or ("Completed" if exit_code == 0 else "Error"),
            "startedAt": _now(), "finishedAt": _now(), "containerID": f"containerd://{name}"}
    if message:
        term["message"] = message
    if signal is not None:
        term["signal"] = signal
    status = {
        "phase": "Succeeded" if exit_code == 0 else "Failed",
        "conditions": [_cond("Initialized", True), _cond("Ready", False), _cond("ContainersReady", False),
                       _cond("PodScheduled", True)],
        "containerStatuses": [{"name": L.ENGINE_CONTAINER, "image": "shoal:test", "imageID": "",
                               "ready": False, "restartCount": 0, "started": False,
                               "state": {"terminated": term}}],
    }
    kube.request("PATCH", f"/api/v1/namespaces/{ns}/pods/{name}/status", body={"status": status},
                 content_type="application/merge-patch+json")


def finish_deletion(kube: Kube, ns: str, name: str) -> None:
    """The kubelet's last step after the container stopped: remove the pod object."""
    kube.delete("v1", "pods", ns, name, grace_seconds=0)


def frontend_pods(kube: Kube, ns: str, name: str) -> list[dict]:
    """The frontend Deployment's pods (made by the real ReplicaSet controller)."""
    sel = f"{L.LABEL_ENGINE}={name},{L.LABEL_COMPONENT}={L.COMPONENT_FRONTEND}"
    return [p for p in kube.list("v1", "pods", ns, sel) if not p["metadata"].get("deletionTimestamp")]


def ready_frontends(kube: Kube, ns: str, name: str, ready: bool = True) -> int:
    """Report every frontend pod of `name` Ready (its /health answered: it reaches a group)."""
    fes = frontend_pods(kube, ns, name)
    for p in fes:
        set_ready(kube, ns, p["metadata"]["name"], ready, container=L.FRONTEND_CONTAINER)
    return len(fes)
