"""`make cluster`: the whole system on the local cluster, from nothing to a completion.

1. the cluster (cluster.start: binaries, images, control plane, two nodes, DNS);
2. the given model copied to the nodes' hostPath (/var/lib/shoal-cluster/models);
3. the Helm chart (the operator as a pod, its ServiceAccount, RBAC enforced);
4. examples/cluster-hostpath.yaml; waits until a completion succeeds through the Service's
   ClusterIP from this machine; prints that URL and the kubectl command to use.

kubectl and helm are given by the caller (the Makefile and the e2e fixture take them from
tests/support/k8s_tools.py), as is the model directory: this package installs neither.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from shoal.devcluster import cluster, explain
from shoal.devcluster.layout import MODEL_HOST_DIR, REPO, logs_dir
from shoal.devcluster.procs import DevClusterError, log

EXAMPLE = REPO / "examples" / "cluster-hostpath.yaml"
CHART = REPO / "charts" / "shoal"
OPERATOR_NS = "shoal-system"
MODEL_STAMP = ".shoal-model-format"


def install_model(src: Path, name: str = "shoal-tiny") -> Path:
    """Copy the model where the example's hostPath points, keeping its file modes (the
    engine runs as uid 10001: the files must be readable by it as made)."""
    dest = MODEL_HOST_DIR / name
    stamp = src / MODEL_STAMP
    if (dest / MODEL_STAMP).is_file() and stamp.is_file() and \
            (dest / MODEL_STAMP).read_text() == stamp.read_text():
        return dest
    MODEL_HOST_DIR.mkdir(parents=True, exist_ok=True)
    for d in (MODEL_HOST_DIR.parent, MODEL_HOST_DIR):
        d.chmod(0o755)
    if dest.exists():
        shutil.rmtree(dest)
    subprocess.run(["cp", "-a", str(src), str(dest)], check=True)
    log(f"model: {src} -> {dest}")
    return dest


class Kube:
    """kubectl and helm against one kubeconfig."""

    def __init__(self, kubeconfig: str, kubectl: Path | str, helm: Path | str) -> None:
        self.kubectl_bin, self.helm_bin = str(kubectl), str(helm)
        self.env = {**os.environ, "KUBECONFIG": kubeconfig}

    def kubectl(self, *args: str, check: bool = True, timeout: float = 120) -> str:
        res = subprocess.run([self.kubectl_bin, *args], env=self.env, capture_output=True,
                             text=True, timeout=timeout)
        if check and res.returncode != 0:
            raise DevClusterError(f"kubectl {' '.join(args)}: {res.stderr.strip()}")
        return res.stdout

    def helm(self, *args: str, timeout: float = 300) -> str:
        res = subprocess.run([self.helm_bin, *args], env=self.env, capture_output=True,
                             text=True, timeout=timeout)
        if res.returncode != 0:
            raise DevClusterError(f"helm {' '.join(args)}: {res.stderr.strip()}")
        return res.stdout

    def get(self, *args: str) -> dict:
        return json.loads(self.kubectl("get", *args, "-o", "json"))

    def explain(self, namespace: str) -> str:
        """Why this namespace's pods are not running (explain.py), best effort."""
        try:
            return explain.explain(self.get("pods", "-n", namespace), self.get("nodes"),
                                   self.get("events", "-n", namespace))
        except (DevClusterError, ValueError, subprocess.TimeoutExpired) as exc:
            return f"(could not read the cluster's state: {exc})"


def install_operator(kube: Kube, timeout: float = 300) -> None:
    log("helm upgrade --install shoal charts/shoal -n shoal-system")
    kube.helm("upgrade", "--install", "shoal", str(CHART), "--namespace", OPERATOR_NS,
              "--create-namespace", "--force-conflicts")
    log("waiting for the operator pod")
    try:
        kube.kubectl("rollout", "status", "deployment/shoal-operator", "-n", OPERATOR_NS,
                     f"--timeout={int(timeout)}s", timeout=timeout + 10)
    except (DevClusterError, subprocess.TimeoutExpired) as exc:
        raise DevClusterError(f"the operator pod did not become ready within {timeout:.0f}s "
                              f"({exc}):\n{kube.explain(OPERATOR_NS)}") from None


def completion(url: str, model: str = "shoal-tiny", timeout: float = 30) -> dict:
    body = json.dumps({"model": model, "prompt": "def fibonacci(n):", "max_tokens": 8}).encode()
    req = urllib.request.Request(f"{url}/completions", data=body,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def _progress(kube: Kube, name: str, namespace: str) -> str:
    ie = kube.kubectl("get", "ie", name, "-n", namespace, "--no-headers", check=False)
    pods = kube.kubectl("get", "pods", "-n", namespace, "-l", f"shoal.dev/engine={name}",
                        "--no-headers", check=False)
    return (f"{' '.join(ie.split()[:3])} | "
            + "; ".join(" ".join(p.split()[:3]) for p in pods.splitlines()))


def wait_serving(kube: Kube, name: str, namespace: str, timeout: float = 600) -> tuple[str, float]:
    """Wait until a completion succeeds through the Service's ClusterIP; progress every 15 s."""
    t0 = time.monotonic()
    next_note = t0
    last_err = ""
    while time.monotonic() - t0 < timeout:
        try:
            svc = kube.get("service", name, "-n", namespace)
            url = f"http://{svc['spec']['clusterIP']}:8000/v1"
            completion(url)
            return url, time.monotonic() - t0
        except (DevClusterError, urllib.error.URLError, OSError, ValueError, KeyError) as exc:
            last_err = str(exc)[:200]
        if time.monotonic() >= next_note:
            next_note += 15
            log(f"waiting for a completion ({time.monotonic() - t0:.0f}s): "
                f"{_progress(kube, name, namespace)}"
                + (f" | last: {last_err}" if last_err else ""))
        time.sleep(1)
    raise DevClusterError(f"no completion through the Service within {timeout:.0f}s: "
                          f"{last_err}\n{kube.explain(namespace)}")


def run_demo(model: Path, kubectl: Path | str, helm: Path | str) -> int:
    """Steps 1-4; prints the endpoint and how to reach the cluster."""
    t0 = time.monotonic()
    try:
        state = cluster.start()
        install_model(model)
        kube = Kube(state["kubeconfig"], kubectl, helm)
        install_operator(kube)
        log(f"kubectl apply -f {EXAMPLE.relative_to(REPO)}")
        kube.kubectl("apply", "-f", str(EXAMPLE))
        url, waited = wait_serving(kube, "shoal-tiny", "default")
    except DevClusterError as exc:
        log(f"ERROR: {exc}")
        log(f"component logs: {logs_dir()}")
        return 1
    log(f"serving after {waited:.0f}s; whole run {time.monotonic() - t0:.0f}s")
    print(f"""
Shoal is serving shoal-tiny on the local cluster.

  OpenAI endpoint (Service ClusterIP, from this machine): {url}
    curl -s {url}/completions -H 'content-type: application/json' \\
      -d '{{"model": "shoal-tiny", "prompt": "def fibonacci(n):", "max_tokens": 32}}'

  kubectl: export KUBECONFIG={state['kubeconfig']}
    {kubectl} get ie,pods -o wide

  stop and remove everything: make cluster-down
""")
    return 0
