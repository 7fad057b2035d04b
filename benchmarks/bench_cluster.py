"""The local cluster for the benchmark scripts that run on it (cluster.py, cold_start.py,
autoscale_trace.py): the one `make cluster` left running, or a new one; with the tiny model on
the nodes and the chart's operator installed. `Cluster.reused` says which: a script stops a
cluster it started (`devcluster.stop()`)."""

from __future__ import annotations

from shoal.devcluster import cluster as devcluster
from shoal.devcluster import demo
from support.cluster import Cluster
from support.k8s_tools import ensure_k8s_tools
from support.models import ensure_model


def local_cluster() -> Cluster:
    was_running = devcluster.running_state() is not None
    state = devcluster.start()
    demo.install_model(ensure_model("shoal-tiny", "tiny"))
    tools = ensure_k8s_tools()
    demo.install_operator(demo.Kube(state["kubeconfig"], tools.kubectl, tools.helm))
    return Cluster(state, was_running)
