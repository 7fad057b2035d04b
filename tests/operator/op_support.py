"""Helpers for the operator's integration tests: the operator as a child process and small
API shortcuts over the operator's own dict client."""

from __future__ import annotations

import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

from kubernetes.client.exceptions import ApiException
from shoal.operator import labels as L
from shoal.operator.kube import Kube
from support.wait import wait_for

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OperatorProcess:
    """`python -m shoal.operator` as a child process: the real thing, as the chart runs it."""

    def __init__(self, control_plane, pattern: str, log_path: Path, stats_path: Path | None = None):
        self.control_plane, self.pattern, self.log_path = control_plane, pattern, log_path
        self.stats_path = stats_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> OperatorProcess:
        port = _free_port()
        env = {**self.control_plane.env(), "PYTHONUNBUFFERED": "1"}
        if self.stats_path:
            env["SHOAL_OPERATOR_STATS_FILE"] = str(self.stats_path)
        self._log = open(self.log_path, "a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shoal.operator", "--namespace", self.pattern,
             "--liveness", f"http://127.0.0.1:{port}/healthz", "--log-level", "info"],
            env=env, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO)

        def alive():
            if self.proc.poll() is not None:
                raise AssertionError(f"operator exited {self.proc.returncode}:\n{self.tail()}")
            try:
                return urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1).status == 200
            except OSError:
                return False

        wait_for(alive, timeout=60, interval=0.2, what="the operator's liveness endpoint")
        return self

    def stop(self, kill: bool = False) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill() if kill else self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc:
            self._log.close()

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


def ie(kube: Kube, ns: str, name: str) -> dict | None:
    return kube.get(L.API_VERSION, L.PLURAL, ns, name)


def pods(kube: Kube, ns: str, name: str, group: int | None = None) -> dict[str, dict]:
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


def settle(pred, timeout=20.0, what=""):
    return wait_for(pred, timeout=timeout, interval=0.2, what=what)



def cleanup_namespace(kube: Kube, ns: str) -> None:
    """Leave nothing that keeps an operator busy: delete the InferenceEngines without waiting
    for their ordered shutdown (no kubelet will finish bound pods), force-delete the engine
    pods, then delete the namespace."""
    for obj in kube.list(L.API_VERSION, L.PLURAL, ns):
        kube.delete(L.API_VERSION, L.PLURAL, ns, obj["metadata"]["name"])
        kube.patch(L.API_VERSION, L.PLURAL, ns, obj["metadata"]["name"], {"metadata": {"finalizers": None}})
    for pod in kube.list("v1", "pods", ns, f"{L.LABEL_COMPONENT}={L.COMPONENT_ENGINE}"):
        kube.delete("v1", "pods", ns, pod["metadata"]["name"], grace_seconds=0)
    kube.delete("v1", "namespaces", None, ns)
