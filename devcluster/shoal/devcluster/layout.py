"""Where the dev cluster lives: its addresses, its directories, and each node's share of both.

Addresses are private ranges that the host's routes do not use (the host has 192.0.2.0/24 and a
default route): the nodes' bridge 10.213.0.0/24, pods 10.214.N.0/24 on node N, Services
10.96.0.0/16 (the control plane's range). Only this harness's own bridge, namespaces and veths
carry them; the host's ip_forward is never touched.

Directories: the Kubernetes binaries under `$SHOAL_CACHE/k8s` (build.sh); the cluster's state
(kubeconfig, certificates, etcd, logs) under `$SHOAL_CACHE/cluster`; what must not outlive a run
(sockets, containerd state, kubelet roots, the model copy) under RUN_DIR and VAR_DIR, removed by
teardown; node image stores under `$SHOAL_CACHE/cluster-nodes` so a warm run does not import the
images again.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
BUILD_SCRIPT = PACKAGE_DIR / "build.sh"
# The checkout the images are built from (its Dockerfile), and the chart and example the demo
# installs: this package is a developer tool of the repository it sits in.
REPO = PACKAGE_DIR.parents[2]

BRIDGE = "shoalbr0"
BRIDGE_CIDR = "10.213.0.0/24"
HOST_IP = "10.213.0.1"  # the API server, DNS and the host end of every node
API_PORT = 6443
POD_CIDR = "10.214.0.0/16"
SERVICE_CIDR = "10.96.0.0/16"
NODE_NAMES = ("shoal-node1", "shoal-node2")
CLUSTER_DOMAIN = "cluster.local"

RUN_DIR = Path("/run/shoal-cluster")  # sockets, containerd state
VAR_DIR = Path("/var/lib/shoal-cluster")  # kubelet roots, CNI state, model copy
MODEL_HOST_DIR = VAR_DIR / "models"  # hostPath of the example's model volume


def cache_root() -> Path:
    return Path(os.environ.get("SHOAL_CACHE", Path.home() / ".cache" / "shoal"))


def k8s_cache() -> Path:
    """build.sh's output: bin/, its stamps, its lock."""
    return cache_root() / "k8s"


def bin_dir() -> Path:
    return k8s_cache() / "bin"


def state_dir() -> Path:
    return cache_root() / "cluster"


def logs_dir() -> Path:
    return state_dir() / "logs"


def state_file() -> Path:
    """Where a running cluster says where everything is (written once it is up)."""
    return state_dir() / "cluster.json"


def images_file() -> Path:
    """The image archives `prepare` built, by name (the supervisor loads exactly these)."""
    return state_dir() / "images.json"


def node_store(node: str) -> Path:
    """Per-node containerd root (image content and snapshots): kept between runs."""
    return cache_root() / "cluster-nodes" / node


def node_ip(index: int) -> str:
    return f"10.213.0.{11 + index}"


def node_pod_cidr(index: int) -> str:
    return f"10.214.{1 + index}.0/24"


@dataclass(frozen=True)
class NodeLayout:
    """One node's name, addresses and directories (nothing here touches the host)."""

    name: str
    index: int

    @property
    def netns(self) -> Path:
        return Path("/run/netns") / self.name

    @property
    def run(self) -> Path:
        return RUN_DIR / self.name

    @property
    def var(self) -> Path:
        return VAR_DIR / self.name

    @property
    def store(self) -> Path:
        return node_store(self.name)

    @property
    def sock(self) -> Path:
        return self.run / "containerd.sock"

    @property
    def mntns(self) -> Path:
        """The file holding the node's mount namespace."""
        return self.run / "ns" / "mnt"

    @property
    def ip(self) -> str:
        return node_ip(self.index)

    @property
    def pod_cidr(self) -> str:
        return node_pod_cidr(self.index)


def nodes() -> list[NodeLayout]:
    return [NodeLayout(name, i) for i, name in enumerate(NODE_NAMES)]
