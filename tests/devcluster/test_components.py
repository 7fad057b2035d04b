"""Each component's command line, from its config (shoal.devcluster.components): pure, so every
flag the harness depends on is checked here without starting anything."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from shoal.devcluster import components as C
from shoal.devcluster.layout import NodeLayout

ROOT = Path("/state")
BIN = Path("/bin-k8s")
SUITE = C.ControlPlaneConfig(root=ROOT, bin_dir=BIN, etcd="/usr/bin/etcd", etcd_port=1001,
                             peer_port=1002, server_port=1003, controller_manager_port=1004,
                             scheduler_port=1005)
CLUSTER = C.ControlPlaneConfig(root=ROOT, bin_dir=BIN, address="10.213.0.1", server_port=6443,
                               controllers=("*",), authorization_mode="RBAC",
                               service_accounts=True)
NODE1, NODE2 = NodeLayout("shoal-node1", 0), NodeLayout("shoal-node2", 1)


def value(argv: list[str], flag: str) -> str | None:
    """The value given to `flag`, as `--flag value` or `--flag=value`; None when absent."""
    for i, arg in enumerate(argv):
        if arg == flag:
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


@pytest.mark.parametrize("build, flag, want", [
    (C.etcd_args, "--data-dir", "/state/etcd"),
    (C.etcd_args, "--listen-client-urls", "http://127.0.0.1:1001"),
    (C.etcd_args, "--listen-peer-urls", "http://127.0.0.1:1002"),
    (C.etcd_args, "--initial-cluster", "shoal-test=http://127.0.0.1:1002"),
    (C.etcd_args, "--quota-backend-bytes", str(2 << 30)),
    (C.apiserver_args, "--etcd-servers", "http://127.0.0.1:1001"),
    (C.apiserver_args, "--bind-address", "127.0.0.1"),
    (C.apiserver_args, "--secure-port", "1003"),
    (C.apiserver_args, "--tls-cert-file", "/state/pki/apiserver.crt"),
    (C.apiserver_args, "--client-ca-file", "/state/pki/ca.crt"),
    (C.apiserver_args, "--requestheader-client-ca-file", "/state/pki/ca.crt"),
    (C.apiserver_args, "--token-auth-file", "/state/tokens.csv"),
    (C.apiserver_args, "--authorization-mode", "AlwaysAllow"),
    (C.apiserver_args, "--service-account-signing-key-file", "/state/pki/sa.key"),
    (C.apiserver_args, "--service-cluster-ip-range", "10.96.0.0/16"),
    (C.apiserver_args, "--disable-admission-plugins", "ServiceAccount"),
    (C.apiserver_args, "--endpoint-reconciler-type", "none"),
    (C.apiserver_args, "--kubelet-preferred-address-types", "InternalIP,ExternalIP,Hostname"),
    (C.controller_manager_args, "--kubeconfig", "/state/kube-controller-manager.kubeconfig"),
    (C.controller_manager_args, "--controllers",
     "garbagecollector,deployment,replicaset,statefulset,namespace"),
    (C.controller_manager_args, "--secure-port", "1004"),
    (C.controller_manager_args, "--port", "0"),
    (C.controller_manager_args, "--service-account-private-key-file", "/state/pki/sa.key"),
    (C.controller_manager_args, "--concurrent-gc-syncs", "20"),
    (C.controller_manager_args, "--leader-elect", "false"),
    (C.scheduler_args, "--kubeconfig", "/state/kube-controller-manager.kubeconfig"),
    (C.scheduler_args, "--secure-port", "1005"),
    (C.scheduler_args, "--bind-address", "127.0.0.1"),
    (C.scheduler_args, "--controllers", None),
])
def test_suite_control_plane_flags(build, flag, want):
    assert value(build(SUITE), flag) == want


@pytest.mark.parametrize("build, flag, want", [
    (C.apiserver_args, "--bind-address", "10.213.0.1"),
    (C.apiserver_args, "--advertise-address", "10.213.0.1"),
    (C.apiserver_args, "--secure-port", "6443"),
    (C.apiserver_args, "--authorization-mode", "RBAC"),
    (C.apiserver_args, "--disable-admission-plugins", None),
    (C.apiserver_args, "--endpoint-reconciler-type", None),
    (C.controller_manager_args, "--controllers", "*"),
    # The controller manager's and scheduler's healthz stay on loopback.
    (C.controller_manager_args, "--bind-address", "127.0.0.1"),
])
def test_cluster_control_plane_flags(build, flag, want):
    assert value(build(CLUSTER), flag) == want


@pytest.mark.parametrize("build, binary", [
    (C.etcd_args, "/usr/bin/etcd"),
    (C.apiserver_args, "/bin-k8s/kube-apiserver"),
    (C.controller_manager_args, "/bin-k8s/kube-controller-manager"),
    (C.scheduler_args, "/bin-k8s/kube-scheduler"),
])
def test_each_component_runs_its_binary(build, binary):
    assert build(SUITE)[0] == binary


def test_authorization_mode_is_its_own_argument():
    """tests/packaging/test_rbac_enforced.py swaps the value after `--authorization-mode`."""
    argv = C.apiserver_args(SUITE)
    assert argv[argv.index("--authorization-mode") + 1] == "AlwaysAllow"


@pytest.mark.parametrize("node, flag, want", [
    (NODE1, "--hostname-override", "shoal-node1"),
    (NODE1, "--node-ip", "10.213.0.11"),
    (NODE2, "--node-ip", "10.213.0.12"),
    (NODE1, "--cgroup-root", "/shoal-node1"),
    (NODE2, "--cgroup-root", "/shoal-node2"),
    (NODE1, "--container-runtime-endpoint", "unix:///run/shoal-cluster/shoal-node1/containerd.sock"),
    (NODE1, "--cluster-dns", "10.213.0.1"),
    (NODE1, "--cluster-domain", "cluster.local"),
    (NODE1, "--root-dir", "/var/lib/shoal-cluster/shoal-node1/kubelet"),
    (NODE1, "--pod-infra-container-image", "pause:1"),
    (NODE1, "--image-gc-high-threshold", "100"),
    (NODE1, "--eviction-hard",
     "memory.available<100Mi,nodefs.available<1Gi,imagefs.available<1Gi"),
    (NODE1, "--kubeconfig", "/k/node.kubeconfig"),
])
def test_kubelet_flags(node, flag, want):
    argv = C.kubelet_args(node, Path("/b/kubelet"), Path("/k/node.kubeconfig"), "pause:1")
    assert value(argv, flag) == want


@pytest.mark.parametrize("build, prefix", [
    (lambda n: C.kubelet_args(n, Path("/b/kubelet"), Path("/k"), "p"),
     ["nsenter", "--net=/run/netns/shoal-node2",
      "--mount=/run/shoal-cluster/shoal-node2/ns/mnt", "/b/kubelet"]),
    (lambda n: C.containerd_args(n, Path("/c.toml")),
     ["nsenter", "--net=/run/netns/shoal-node2",
      "--mount=/run/shoal-cluster/shoal-node2/ns/mnt", "containerd"]),
    # kube-proxy only needs the node's network (its iptables), not its mounts.
    (lambda n: C.kube_proxy_args(n, Path("/b/kube-proxy"), Path("/k")),
     ["nsenter", "--net=/run/netns/shoal-node2", "/b/kube-proxy"]),
])
def test_node_processes_run_inside_the_node(build, prefix):
    assert build(NODE2)[:len(prefix)] == prefix


@pytest.mark.parametrize("flag, want", [
    ("--bind-address", "10.213.0.12"),
    ("--hostname-override", "shoal-node2"),
    ("--cluster-cidr", "10.214.0.0/16"),
    ("--proxy-mode", "iptables"),
    ("--masquerade-all", "true"),
    ("--conntrack-max-per-core", "0"),
])
def test_kube_proxy_flags(flag, want):
    assert value(C.kube_proxy_args(NODE2, Path("/b/kube-proxy"), Path("/k")), flag) == want


@pytest.mark.parametrize("node, line", [
    (NODE1, 'address = "/run/shoal-cluster/shoal-node1/containerd.sock"'),
    (NODE1, 'sandbox_image = "pause:1"'),
    (NODE1, "restrict_oom_score_adj = true"),
    (NODE2, 'conf_dir = "/var/lib/shoal-cluster/shoal-node2/cni"'),
    (NODE2, 'Root = "/run/shoal-cluster/shoal-node2/runc"'),
])
def test_containerd_config(node, line):
    assert line in [ln.strip() for ln in C.containerd_config(node, "pause:1").splitlines()]


@pytest.mark.parametrize("node, subnet", [(NODE1, "10.214.1.0/24"), (NODE2, "10.214.2.0/24")])
def test_cni_config_gives_each_node_its_pod_range(node, subnet):
    cfg = json.loads(json.dumps(C.cni_config(node)))  # JSON-serialisable as written
    bridge = cfg["plugins"][0]
    assert cfg["name"] == node.name
    assert bridge["ipam"]["ranges"] == [[{"subnet": subnet}]]
    assert bridge["ipMasq"] is False


@pytest.mark.parametrize("flag, want", [
    ("--listen-address", "10.213.0.1"),
    ("--hostsdir", "/h"),
    ("--local", "/cluster.local/"),
    ("--local-ttl", "0"),
    ("--pid-file", "/p.pid"),
])
def test_dnsmasq_flags(flag, want):
    argv = C.dnsmasq_args(Path("/h"), Path("/p.pid"))
    assert value(argv, flag) == want
    assert "--no-resolv" in argv  # no upstream: nothing leaves the machine
