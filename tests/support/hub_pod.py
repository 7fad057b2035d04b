"""The stand-in hub (support/stand_in_hub.py) as a pod of the router image on the local cluster,
behind a Service: its script from a ConfigMap, its repositories the nodes' model hostPath (the
project's models under ORG `shoal`, so `hf://shoal/shoal-tiny`). Used by the e2e tier and by
benchmarks/cold_start.py. A stand-in because no real hub is reachable here; the client that
talks to it (`shoal fetch`, huggingface_hub) and its cache are real."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from shoal.devcluster.images import ROUTER_TAG
from shoal.devcluster.layout import MODEL_HOST_DIR

SCRIPT = Path(__file__).resolve().parent / "stand_in_hub.py"
ORG = "shoal"
PORT = 8080
TOKEN = "hf_e2e_token"


def objects(ns: str, token: str = TOKEN) -> list[dict]:
    """The hub's Pod and Service (the ConfigMap `stand-in-hub` is made from SCRIPT by start)."""
    labels = {"app": "hub"}
    root = {"name": "repos", "hostPath": {"path": str(MODEL_HOST_DIR), "type": "Directory"}}
    pod = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "hub", "namespace": ns,
                                                        "labels": labels},
        "spec": {
            "containers": [{
                "name": "hub", "image": ROUTER_TAG, "imagePullPolicy": "IfNotPresent",
                "command": ["python", "/hub/stand_in_hub.py", "--root", "/repos",
                            "--port", str(PORT), "--token", token],
                "ports": [{"containerPort": PORT}],
                "readinessProbe": {"tcpSocket": {"port": PORT}, "periodSeconds": 1},
                "volumeMounts": [{"name": "script", "mountPath": "/hub"},
                                 {"name": "repos", "mountPath": f"/repos/{ORG}",
                                  "readOnly": True}],
                "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}},
            }],
            "volumes": [{"name": "script", "configMap": {"name": "stand-in-hub"}}, root],
        },
    }
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "hub", "namespace": ns},
           "spec": {"selector": labels, "ports": [{"port": PORT, "targetPort": PORT}]}}
    return [pod, svc]


def start(cluster, ns: str, token: str = TOKEN) -> dict:
    """Run the hub in `ns`; returns its in-cluster endpoint (HF_ENDPOINT) and its /_stats URL
    as seen from the host."""
    cluster.kubectl("create", "configmap", "stand-in-hub", "-n", ns,
                    f"--from-file=stand_in_hub.py={SCRIPT}")
    for obj in objects(ns, token):
        cluster.apply(obj)
    cluster.kubectl("wait", "--for=condition=Ready", "pod/hub", "-n", ns, "--timeout=180s",
                    timeout=200)
    ip = cluster.get("service", "hub", "-n", ns)["spec"]["clusterIP"]
    return {"endpoint": f"http://hub.{ns}.svc.cluster.local:{PORT}",
            "stats": f"http://{ip}:{PORT}/_stats"}


def stats(hub: dict) -> dict:
    with urllib.request.urlopen(hub["stats"], timeout=10) as r:
        return json.load(r)


def downloads_since(hub: dict, before: dict, repo: str) -> dict[str, int]:
    """Files of `repo` downloaded since `before` (a stats()["downloads"]), with their counts."""
    return {k: n - before.get(k, 0) for k, n in stats(hub)["downloads"].items()
            if k.startswith(repo + "/") and n - before.get(k, 0)}
