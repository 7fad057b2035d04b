"""Real `prometheus` and `promtool` for the alert tests, from Debian's `prometheus` package,
`PrometheusServer`: a `prometheus` of a test's own (its config, its rule file, a free port), and
`PodDiscovery`: Kubernetes pod discovery for it through a file.

Debian's prometheus (2.42.0+ds) is built without `kubernetes_sd_configs` (its config loader
says "field kubernetes_sd_configs not found"), so `PodDiscovery` does what its `role: pod`
does: it lists the pods through the API every second and writes one target per container port
with the same `__meta_kubernetes_*` labels into a `file_sd_configs` file. The shipped scrape
jobs' relabel rules then run unchanged.

Installed once per machine with apt-get (as root, like devcluster/shoal/devcluster/build.sh),
under a file lock so that concurrent test runs install once; dpkg's own lock is waited for
(another apt-get may be running). `--no-install-recommends`: the node exporter is not needed.
Debian starts the packaged service where services may start (not in containers, whose
policy-rc.d refuses); the tests never use it: they run their own `prometheus` on a free port.

A machine where it is missing and cannot be installed makes the tests fail with the reason
(`PrometheusMissing`), never skip.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import threading
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml
from support.k8s_tools import cache_dir
from support.net import free_port
from support.wait import wait_for

PACKAGE = "prometheus"  # Debian bookworm: 2.42.0+ds


class PrometheusMissing(RuntimeError):
    """promtool or prometheus is not installed and could not be; str() says why."""


@dataclass(frozen=True)
class PrometheusTools:
    prometheus: Path
    promtool: Path


def _found() -> PrometheusTools | None:
    prometheus, promtool = shutil.which("prometheus"), shutil.which("promtool")
    if prometheus and promtool:
        return PrometheusTools(Path(prometheus), Path(promtool))
    return None


def _apt(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    return subprocess.run(["apt-get", "-o", "DPkg::Lock::Timeout=600", *args], env=env,
                          capture_output=True, text=True, timeout=900)


def _install() -> None:
    if os.geteuid() != 0:
        raise PrometheusMissing(f"promtool/prometheus not on PATH and not root: install Debian's "
                                f"`{PACKAGE}` package (apt-get install {PACKAGE})")
    if shutil.which("apt-get") is None:
        raise PrometheusMissing(f"promtool/prometheus not on PATH and no apt-get to install "
                                f"Debian's `{PACKAGE}` package")
    install = ("install", "-y", "-qq", "--no-install-recommends", PACKAGE)
    proc = _apt(*install)
    if proc.returncode != 0:  # a fresh machine: no package lists yet
        update = _apt("update", "-qq")
        if update.returncode != 0:
            raise PrometheusMissing(f"apt-get update failed: {update.stderr.strip()[-2000:]}")
        proc = _apt(*install)
    if proc.returncode != 0:
        raise PrometheusMissing(f"apt-get install {PACKAGE} failed (exit {proc.returncode}): "
                                f"{proc.stderr.strip()[-2000:]}")


def ensure_prometheus() -> PrometheusTools:
    """The installed tools, installing Debian's package first where needed."""
    tools = _found()
    if tools is not None:
        return tools
    lock_dir = cache_dir() / "tools"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / ".prometheus.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _found() is None:
            _install()
    tools = _found()
    if tools is None:
        raise PrometheusMissing(f"apt-get installed {PACKAGE}, but prometheus/promtool are "
                                f"still not on PATH ({os.environ.get('PATH')})")
    return tools


class PrometheusServer:
    """`prometheus` on 127.0.0.1 with `config` (a prometheus.yml as a dict; its `rule_files`
    are written from `rules`: file name -> text), its data and log under `tmp`."""

    def __init__(self, config: dict, rules: dict[str, str], tmp: Path) -> None:
        self.tmp, self.port = tmp, free_port()
        for name, text in rules.items():
            (tmp / name).write_text(text)
        (tmp / "prometheus.yml").write_text(yaml.safe_dump({**config,
                                                            "rule_files": sorted(rules)}))
        self.log_path = tmp / "prometheus.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [str(ensure_prometheus().prometheus), f"--config.file={tmp / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def _get(self, path: str, **params) -> dict:
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited {self.proc.returncode}:\n{self.log()}")
        url = f"http://127.0.0.1:{self.port}{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.load(r)

    def wait_ready(self, timeout: float = 60) -> PrometheusServer:
        def ready() -> bool:
            try:
                return bool(self._get("/api/v1/status/runtimeinfo"))
            except OSError:
                return False

        wait_for(ready, timeout=timeout, interval=0.3, what="prometheus to answer",
                 detail=self.log)
        return self

    def query(self, expr: str) -> list[dict]:
        """An instant query's vector (each item: metric labels and value)."""
        return self._get("/api/v1/query", query=expr)["data"]["result"]

    def alerts(self) -> list[dict]:
        """/api/v1/alerts: pending and firing alerts (resolved ones are not listed)."""
        return self._get("/api/v1/alerts")["data"]["alerts"]

    def targets(self) -> list[dict]:
        return self._get("/api/v1/targets")["data"]["activeTargets"]

    def log(self, lines: int = 40) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()


def _clean(key: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", key)


def pod_targets(pods: list[dict]) -> list[dict]:
    """file_sd target groups for pods (API dicts), labelled as kubernetes_sd `role: pod` labels
    a container port's target; pods without an IP yet have none."""
    groups = []
    for pod in pods:
        meta, status = pod["metadata"], pod.get("status") or {}
        ip = status.get("podIP")
        if not ip:
            continue
        ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                    for c in status.get("conditions") or [])
        common = {"__meta_kubernetes_namespace": meta["namespace"],
                  "__meta_kubernetes_pod_name": meta["name"],
                  "__meta_kubernetes_pod_uid": meta.get("uid", ""),
                  "__meta_kubernetes_pod_ip": ip,
                  "__meta_kubernetes_pod_ready": str(ready).lower(),
                  "__meta_kubernetes_pod_phase": status.get("phase", ""),
                  "__meta_kubernetes_pod_node_name": (pod.get("spec") or {}).get("nodeName", "")}
        for k, v in (meta.get("labels") or {}).items():
            common[f"__meta_kubernetes_pod_label_{_clean(k)}"] = v
            common[f"__meta_kubernetes_pod_labelpresent_{_clean(k)}"] = "true"
        for k, v in (meta.get("annotations") or {}).items():
            common[f"__meta_kubernetes_pod_annotation_{_clean(k)}"] = v
        for c in pod["spec"]["containers"]:
            for port in c.get("ports") or []:
                groups.append({"targets": [f"{ip}:{port['containerPort']}"], "labels": {
                    **common, "__meta_kubernetes_pod_container_name": c["name"],
                    "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
                    "__meta_kubernetes_pod_container_port_number": str(port["containerPort"]),
                    "__meta_kubernetes_pod_container_port_protocol": port.get("protocol", "TCP"),
                }})
    return groups


class PodDiscovery:
    """A thread writing `pod_targets(list_pods())` to `path` every `interval` seconds (the file
    is replaced, never half-written); file_sd reads it."""

    def __init__(self, list_pods: Callable[[], list[dict]], path: Path, interval: float = 1.0):
        self.list_pods, self.path, self.interval = list_pods, path, interval
        self.error: Exception | None = None
        self._stop = threading.Event()
        self._write()  # the first targets are there before Prometheus starts
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(pod_targets(self.list_pods()), sort_keys=True))
        os.replace(tmp, self.path)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._write()
                self.error = None
            except Exception as e:  # noqa: BLE001 - the test reports it, the next try may work
                self.error = e

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


if __name__ == "__main__":
    t = ensure_prometheus()
    print(f"prometheus: {t.prometheus}\npromtool:   {t.promtool}")
