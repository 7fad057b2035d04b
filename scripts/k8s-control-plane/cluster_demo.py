"""`make cluster`: the whole system on the local cluster, from nothing to a completion.

1. the cluster (cluster.py start: binaries, images, control plane, two nodes, DNS);
2. the project's model copied to the nodes' hostPath (/var/lib/shoal-cluster/models);
3. the Helm chart (the operator as a pod, its ServiceAccount, RBAC enforced);
4. examples/cluster-hostpath.yaml; waits until a completion succeeds through the Service's
   ClusterIP from this machine; prints that URL and the kubectl command to use.

Run with the project's venv (`make cluster`); kubectl and helm come from tests/support/k8s_tools.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import cluster
import cluster_explain
from cluster_common import MODEL_HOST_DIR, REPO, ClusterError, log

sys.path.insert(0, str(REPO / "tests"))
from support.k8s_tools import ensure_k8s_tools  # noqa: E402

EXAMPLE = REPO / "examples" / "cluster-hostpath.yaml"
CHART = REPO / "charts" / "shoal"
OPERATOR_NS = "shoal-system"


def install_model(src: Path, name: str = "shoal-tiny") -> Path:
    """Copy the model where the example's hostPath points, keeping its file modes (the
    engine runs as uid 10001: the files must be readable by it as made)."""
    dest = MODEL_HOST_DIR / name
    stamp = src / ".shoal-model-format"
    if (dest / ".shoal-model-format").is_file() and stamp.is_file() and \
            (dest / ".shoal-model-format").read_text() == stamp.read_text():
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
    def __init__(self, kubeconfig: str) -> None:
        self.tools = ensure_k8s_tools()
        self.env = {**os.environ, "KUBECONFIG": kubeconfig}

    def kubectl(self, *args: str, check: bool = True, timeout: float = 120) -> str:
        res = subprocess.run([str(self.tools.kubectl), *args], env=self.env, capture_output=True,
                             text=True, timeout=timeout)
        if check and res.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args)}: {res.stderr.strip()}")
        return res.stdout

    def helm(self, *args: str, timeout: float = 300) -> str:
        res = subprocess.run([str(self.tools.helm), *args], env=self.env, capture_output=True,
                             text=True, timeout=timeout)
        if res.returncode != 0:
            raise ClusterError(f"helm {' '.join(args)}: {res.stderr.strip()}")
        return res.stdout

    def get(self, *args: str) -> dict:
        return json.loads(self.kubectl("get", *args, "-o", "json"))

    def explain(self, namespace: str) -> str:
        """Why this namespace's pods are not running (cluster_explain), best effort."""
        try:
            return cluster_explain.explain(self.get("pods", "-n", namespace), self.get("nodes"),
                                           self.get("events", "-n", namespace))
        except (ClusterError, ValueError, subprocess.TimeoutExpired) as exc:
            return f"(could not read the cluster's state: {exc})"


def install_operator(kube: Kube, timeout: float = 300) -> None:
    log("helm upgrade --install shoal charts/shoal -n shoal-system")
    kube.helm("upgrade", "--install", "shoal", str(CHART), "--namespace", OPERATOR_NS,
              "--create-namespace", "--force-conflicts")
    log("waiting for the operator pod")
    try:
        kube.kubectl("rollout", "status", "deployment/shoal-operator", "-n", OPERATOR_NS,
                     f"--timeout={int(timeout)}s", timeout=timeout + 10)
    except (ClusterError, subprocess.TimeoutExpired) as exc:
        raise ClusterError(f"the operator pod did not become ready within {timeout:.0f}s "
                           f"({exc}):\n{kube.explain(OPERATOR_NS)}") from None


def completion(url: str, model: str = "shoal-tiny", timeout: float = 30) -> dict:
    body = json.dumps({"model": model, "prompt": "def fibonacci(n):", "max_tokens": 8}).encode()
    req = urllib.request.Request(f"{url}/completions", data=body,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def wait_serving(kube: Kube, name: str, namespace: str, timeout: float = 600) -> tuple[str, float]:
    """Wait until a completion succeeds through the Service's ClusterIP; progress every 15 s."""
    t0 = time.monotonic()
    next_note = t0
    last_err = ""
    while time.monotonic() - t0 < timeout:
        url = None
        try:
            svc = kube.get("service", name, "-n", namespace)
            url = f"http://{svc['spec']['clusterIP']}:8000/v1"
            completion(url)
            return url, time.monotonic() - t0
        except (ClusterError, urllib.error.URLError, OSError, ValueError, KeyError) as exc:
            last_err = str(exc)[:200]
        if time.monotonic() >= next_note:
            next_note += 15
            ie = kube.kubectl("get", "ie", name, "-n", namespace, "--no-headers", check=False)
            pods = kube.kubectl("get", "pods", "-n", namespace, "-l", f"shoal.dev/engine={name}",
                                "--no-headers", check=False)
            log(f"waiting for a completion ({time.monotonic() - t0:.0f}s): "
                f"{' '.join(ie.split()[:3])} | "
                + "; ".join(" ".join(p.split()[:3]) for p in pods.splitlines())
                + (f" | last: {last_err}" if last_err else ""))
        time.sleep(1)
    raise ClusterError(f"no completion through the Service within {timeout:.0f}s: {last_err}\n"
                       f"{kube.explain(namespace)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="the model directory to serve")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    try:
        state = cluster.start()
        install_model(args.model)
        kube = Kube(state["kubeconfig"])
        install_operator(kube)
        log(f"kubectl apply -f {EXAMPLE.relative_to(REPO)}")
        kube.kubectl("apply", "-f", str(EXAMPLE))
        url, waited = wait_serving(kube, "shoal-tiny", "default")
    except ClusterError as exc:
        log(f"ERROR: {exc}")
        log(f"component logs: {cluster.logs_dir()}")
        return 1
    log(f"serving after {waited:.0f}s; whole run {time.monotonic() - t0:.0f}s")
    print(f"""
Shoal is serving shoal-tiny on the local cluster.

  OpenAI endpoint (Service ClusterIP, from this machine): {url}
    curl -s {url}/completions -H 'content-type: application/json' \\
      -d '{{"model": "shoal-tiny", "prompt": "def fibonacci(n):", "max_tokens": 32}}'

  kubectl: export KUBECONFIG={state['kubeconfig']}
    {ensure_k8s_tools().kubectl} get ie,pods -o wide

  stop and remove everything: make cluster-down
""")
    return 0


if __name__ == "__main__":
    sys.exit(main())
