"""Play the kubelet (and the scheduler): the suite's one fake kubelet, for the control-plane,
operator and gateway tests and the operator benchmark.

Why: the test control plane has no kubelet, scheduler or container runtime, so pods stay Pending
with an empty status. Tests that need "the container is running and ready" or "the container
died with exit code 1 and this termination message" write that status here, through the
pods/status subresource; the operator and the StatefulSet controller then see exactly what they
would see on a real node.

An unbound pod is removed at once when deleted (the API server skips graceful deletion for
unscheduled pods), which is what tests of restarts want; `bind` a pod to a (fake) node to make
its deletion graceful, then `finish_deletion` as the kubelet does once the container stopped.

All functions take a `kubernetes.client.CoreV1Api` and the pod's name and namespace; those that
write status return the updated V1Pod.
"""

from __future__ import annotations

import datetime as _dt
import functools
import threading
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from shoal.contract.labels import COMPONENT_FRONTEND, LABEL_COMPONENT, LABEL_ENGINE
from urllib3.exceptions import HTTPError

FAKE_NODE_IP = "10.244.0.1"


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _pod_ip(pod: client.V1Pod) -> str:
    # Stable per pod name, unique enough for a test namespace.
    h = sum(pod.metadata.name.encode()) + 7 * len(pod.metadata.name)
    return f"10.244.{1 + h // 250 % 250}.{1 + h % 250}"


def _condition(kind: str, status: bool, reason: str | None = None) -> dict[str, Any]:
    cond: dict[str, Any] = {
        "type": kind,
        "status": "True" if status else "False",
        "lastProbeTime": None,
        "lastTransitionTime": _now(),
    }
    if reason:
        cond["reason"] = reason
    return cond


def _pod_conditions(ready: bool) -> list[dict[str, Any]]:
    """A scheduled, initialised pod's conditions; Ready and ContainersReady follow `ready`."""
    why = None if ready else "ContainersNotReady"
    return [_condition("Initialized", True), _condition("Ready", ready, why),
            _condition("ContainersReady", ready, why), _condition("PodScheduled", True)]


def _container_names(pod: client.V1Pod, container: str | None) -> list[str]:
    names = [c.name for c in pod.spec.containers]
    if container is not None and container not in names:
        raise ValueError(f"pod {pod.metadata.name} has no container {container!r} (has {names})")
    return names


def _existing_statuses(core: client.CoreV1Api, pod: client.V1Pod) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for cs in (pod.status.container_statuses or []) if pod.status else []:
        out[cs.name] = core.api_client.sanitize_for_serialization(cs)
    return out


def _base_status(pod: client.V1Pod, name: str, old: dict[str, dict[str, Any]]) -> dict[str, Any]:
    spec = next(c for c in pod.spec.containers if c.name == name)
    prev = old.get(name, {})
    return {
        "name": name,
        "image": spec.image,
        "imageID": f"docker-pullable://{spec.image}@sha256:{'0' * 64}",
        "containerID": prev.get("containerID") or f"containerd://{name}-{pod.metadata.uid[:12]}",
        "restartCount": prev.get("restartCount", 0),
        "ready": False,
        "started": False,
        "state": {"waiting": {"reason": "ContainerCreating"}},
    }


def _patch(core: client.CoreV1Api, pod: client.V1Pod, status: dict[str, Any]) -> client.V1Pod:
    status.setdefault("hostIP", FAKE_NODE_IP)
    status.setdefault(
        "startTime",
        (
            pod.status.start_time.strftime("%Y-%m-%dT%H:%M:%SZ")
            if pod.status and pod.status.start_time
            else _now()
        ),
    )
    # A merge patch replaces the lists (conditions, containerStatuses) wholesale, as a kubelet's
    # status update does; resourceVersion makes a concurrent writer fail loudly (409).
    body = {"metadata": {"resourceVersion": pod.metadata.resource_version}, "status": status}
    return core.patch_namespaced_pod_status(
        pod.metadata.name,
        pod.metadata.namespace,
        body,
        _content_type="application/merge-patch+json",
    )


def _retry_conflicts(fn):
    """Re-read and re-apply on 409: a controller may update the pod between read and patch."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        for attempt in range(10):
            try:
                return fn(*args, **kwargs)
            except ApiException as exc:
                if exc.status != 409 or attempt == 9:
                    raise

    return wrapper


def _read(core: client.CoreV1Api, name: str, namespace: str) -> client.V1Pod:
    return core.read_namespaced_pod(name, namespace)


@_retry_conflicts
def set_running(
    core: client.CoreV1Api,
    name: str,
    namespace: str,
    ready: bool = True,
    containers: list[str] | None = None,
) -> client.V1Pod:
    """All (or the named) containers running; pod Running, Ready iff `ready` and all running."""
    pod = _read(core, name, namespace)
    names = _container_names(pod, None)
    which = set(containers or names)
    old = _existing_statuses(core, pod)
    statuses = []
    for n in names:
        st = _base_status(pod, n, old)
        if n in which:
            st.update(ready=ready, started=True, state={"running": {"startedAt": _now()}})
        elif n in old:
            st = old[n]
        if n in old and "lastState" in old[n] and old[n]["lastState"]:
            st["lastState"] = old[n]["lastState"]
        statuses.append(st)
    all_ready = all(s.get("ready") for s in statuses)
    status = {
        "phase": "Running",
        "podIP": _pod_ip(pod),
        "podIPs": [{"ip": _pod_ip(pod)}],
        "conditions": _pod_conditions(all_ready),
        "containerStatuses": statuses,
    }
    return _patch(core, pod, status)


def set_ready(core: client.CoreV1Api, name: str, namespace: str) -> client.V1Pod:
    """Shorthand: every container running and ready."""
    return set_running(core, name, namespace, ready=True)


@_retry_conflicts
def set_terminated(
    core: client.CoreV1Api,
    name: str,
    namespace: str,
    exit_code: int = 1,
    container: str | None = None,
    message: str = "",
    reason: str | None = None,
    signal: int | None = None,
    restarted: bool = False,
) -> client.V1Pod:
    """One container (default: the first) terminated with `exit_code`, `signal`, `message`.

    restarted=False: the container's current state is `terminated`; with restartPolicy Never the
    pod phase becomes Failed (exit code != 0) or Succeeded once all containers are terminated.
    restarted=True: what a kubelet shows after restarting a crashed container (restartPolicy
    Always, as in a StatefulSet): `lastState.terminated` holds the death, `state.waiting` is
    CrashLoopBackOff, restartCount goes up by one, and the pod is Running but not Ready.
    `reason` defaults to "Error" (or "Completed" for exit code 0, "OOMKilled" for 137 if given).
    """
    pod = _read(core, name, namespace)
    names = _container_names(pod, container)
    target = container or names[0]
    old = _existing_statuses(core, pod)
    started = (old.get(target, {}).get("state") or {}).get("running", {}).get("startedAt") or _now()
    terminated: dict[str, Any] = {
        "exitCode": exit_code,
        "reason": reason or ("Completed" if exit_code == 0 else "Error"),
        "startedAt": started,
        "finishedAt": _now(),
        "containerID": old.get(target, {}).get("containerID")
        or f"containerd://{target}-{pod.metadata.uid[:12]}",
    }
    if message:
        terminated["message"] = message
    if signal is not None:
        terminated["signal"] = signal

    statuses = []
    for n in names:
        st = old.get(n) or _base_status(pod, n, old)
        if n == target:
            st = _base_status(pod, n, old)
            if restarted:
                st["restartCount"] = st["restartCount"] + 1
                st["lastState"] = {"terminated": terminated}
                st["state"] = {
                    "waiting": {
                        "reason": "CrashLoopBackOff",
                        "message": f"back-off restarting failed container {n} in pod {name}",
                    }
                }
            else:
                st["state"] = {"terminated": terminated}
                if old.get(n, {}).get("lastState"):
                    st["lastState"] = old[n]["lastState"]
            st["ready"] = False
            st["started"] = False
        statuses.append(st)

    all_terminated = all("terminated" in (s.get("state") or {}) for s in statuses)
    restart_policy = pod.spec.restart_policy or "Always"
    if all_terminated and restart_policy == "Never" and not restarted:
        failed = any(s["state"]["terminated"]["exitCode"] != 0 for s in statuses)
        phase = "Failed" if failed else "Succeeded"
    else:
        phase = "Running"
    status = {
        "phase": phase,
        "podIP": _pod_ip(pod),
        "podIPs": [{"ip": _pod_ip(pod)}],
        "conditions": _pod_conditions(ready=False),
        "containerStatuses": statuses,
    }
    return _patch(core, pod, status)


@_retry_conflicts
def set_waiting(
    core: client.CoreV1Api,
    name: str,
    namespace: str,
    reason: str = "ImagePullBackOff",
    message: str = "",
    container: str | None = None,
) -> client.V1Pod:
    """A container stuck before running (image pull, config error); other containers keep
    their state. The pod is Pending unless it was already Running (then it stays Running)."""
    pod = _read(core, name, namespace)
    names = _container_names(pod, container)
    target = container or names[0]
    old = _existing_statuses(core, pod)
    statuses = []
    for n in names:
        st = old.get(n) or _base_status(pod, n, old)
        if n == target:
            st = _base_status(pod, n, old)
            st["state"] = {
                "waiting": {"reason": reason, **({"message": message} if message else {})}
            }
            if old.get(n, {}).get("lastState"):
                st["lastState"] = old[n]["lastState"]
        statuses.append(st)
    was_running = bool(pod.status and pod.status.phase == "Running")
    status = {
        "phase": "Running" if was_running else "Pending",
        "conditions": _pod_conditions(ready=False),
        "containerStatuses": statuses,
    }
    return _patch(core, pod, status)


def bind(core: client.CoreV1Api, name: str, namespace: str, node: str = "node-a") -> None:
    """What the scheduler does: a bound pod is deleted gracefully (it waits for its kubelet)."""
    body = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": name},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node}}
    # The client cannot read the Binding the server answers with: the raw response is enough.
    core.create_namespaced_pod_binding(name, namespace, body, _preload_content=False)


def finish_deletion(core: client.CoreV1Api, name: str, namespace: str) -> None:
    """The kubelet's last step after the container stopped: remove the pod object."""
    try:
        core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
    except ApiException as exc:
        if exc.status != 404:
            raise


def frontend_pods(core: client.CoreV1Api, engine: str, namespace: str) -> list[client.V1Pod]:
    """An InferenceEngine's frontend pods (made by the real ReplicaSet controller), not stopping."""
    selector = f"{LABEL_ENGINE}={engine},{LABEL_COMPONENT}={COMPONENT_FRONTEND}"
    pods = core.list_namespaced_pod(namespace, label_selector=selector).items
    return [p for p in pods if p.metadata.deletion_timestamp is None]


def ready_frontends(core: client.CoreV1Api, engine: str, namespace: str,
                    ready: bool = True) -> int:
    """Report every frontend pod of `engine` Ready (its /health answered: it reaches a group);
    how many there were."""
    fes = frontend_pods(core, engine, namespace)
    for p in fes:
        set_running(core, p.metadata.name, namespace, ready=ready)
    return len(fes)


class Kubelet(threading.Thread):
    """Plays the kubelet for one InferenceEngine's engine pods in a thread, as long as it runs:
    binds every new pod to `node` and reports it Ready; a pod asked to stop exits 0 and goes
    (the engine drained at once). `pause()` holds it (pods stay as they are) until `resume()`."""

    def __init__(self, core: client.CoreV1Api, namespace: str, engine: str,
                 node: str = "node-a") -> None:
        super().__init__(daemon=True)
        self.core, self.namespace, self.node = core, namespace, node
        self.selector = f"{LABEL_ENGINE}={engine},{LABEL_COMPONENT}=engine"
        self._halt, self._held = threading.Event(), threading.Event()
        self.errors: list[str] = []

    def run(self) -> None:
        while not self._halt.wait(0.3):
            if self._held.is_set():
                continue
            try:
                self._step()
            except ApiException as exc:  # a pod that went meanwhile: next round
                if exc.status not in (404, 409):
                    self.errors.append(f"{exc.status}: {exc.reason}")
            except (OSError, HTTPError) as exc:  # an API server that is down: next round
                self.errors.append(f"{type(exc).__name__}: {exc}")

    def _step(self) -> None:
        for p in self.core.list_namespaced_pod(self.namespace,
                                               label_selector=self.selector).items:
            name = p.metadata.name
            if p.metadata.deletion_timestamp is not None:
                if p.spec.node_name:
                    set_terminated(self.core, name, self.namespace, exit_code=0)
                finish_deletion(self.core, name, self.namespace)
            elif not p.spec.node_name:
                bind(self.core, name, self.namespace, self.node)
                set_ready(self.core, name, self.namespace)

    def pause(self) -> None:
        self._held.set()

    def resume(self) -> None:
        self._held.clear()

    def stop(self) -> None:
        self._halt.set()
        self.join(10)
