"""One node: containerd + runc + kubelet + kube-proxy inside the node's network namespace.

Processes are started with `nsenter --net=/run/netns/NODE` (not `ip netns exec`, which remounts
/sys and hides the cgroup mounts from the kubelet); they share the host's mount namespace, so
their mounts (container root filesystems, pod volumes) are cleaned by teardown.

Per node: containerd's image store under `$SHOAL_CACHE/cluster-nodes/NODE` (kept: a warm run
does not import images again), its state and sockets under RUN_DIR/NODE, the kubelet's root and
the CNI configuration under VAR_DIR/NODE, and its own cgroup root `/NODE` (two kubelets must not
share `/kubepods`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from cluster_common import (
    HOST_IP,
    POD_CIDR,
    RUN_DIR,
    VAR_DIR,
    netns_name,
    node_ip,
    node_pod_cidr,
    node_store,
    run,
)

CGROUP_FS = Path("/sys/fs/cgroup")
CNI_BIN = "/usr/lib/cni"
CLUSTER_DOMAIN = "cluster.local"


@dataclass
class NodePaths:
    name: str
    index: int

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
    def ip(self) -> str:
        return node_ip(self.index)


# Fixed paths in the kubelet (no flag): each node gets its own, bind-mounted in its namespace.
PRIVATE_DIRS = ("/var/log/pods", "/var/log/containers", "/var/lib/kubelet/device-plugins")


def nsenter(node: str) -> list[str]:
    return ["nsenter", f"--net=/run/netns/{netns_name(node)}"]


def mntns_file(n: NodePaths) -> Path:
    return n.run / "ns" / "mnt"


def make_mount_namespace(n: NodePaths) -> None:
    """A mount namespace of the node's own (slave of the host's), held by a file, in which its
    containerd and kubelet run. Why: the kubelet's log directories are fixed paths, and each
    kubelet's garbage collector deletes the directories of pods it does not know, i.e. the other
    node's pods (whose `kubectl logs` and FallbackToLogsOnError termination messages then fail),
    and both would register their device plugins at one socket. Here each node has its own
    directories, bind-mounted over those paths. The node's mounts (container
    root filesystems, volumes) stay in it and go when it does."""
    holder = mntns_file(n).parent
    holder.mkdir(parents=True, exist_ok=True)
    run(["mount", "--bind", str(holder), str(holder)])
    run(["mount", "--make-private", str(holder)])
    mntns_file(n).touch()
    run(["unshare", f"--mount={mntns_file(n)}", "--propagation", "slave", "true"])
    for path in PRIVATE_DIRS:
        own = n.var / "private" / path.strip("/").replace("/", "_")
        own.mkdir(parents=True, exist_ok=True)
        Path(path).mkdir(parents=True, exist_ok=True)
        run(["nsenter", f"--mount={mntns_file(n)}", "mount", "--bind", str(own), path])


def enter(n: NodePaths) -> list[str]:
    """The node's network and mount namespaces (for containerd and the kubelet)."""
    return [*nsenter(n.name), f"--mount={mntns_file(n)}"]


def containerd_config(n: NodePaths, pause_tag: str) -> str:
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return f"""version = 2
root = "{n.store / 'containerd'}"
state = "{n.run / 'containerd-state'}"
oom_score = 0

[grpc]
  address = "{n.sock}"
[ttrpc]
  address = "{n.run / 'containerd.sock.ttrpc'}"
[debug]
  address = ""
[metrics]
  address = ""

[{cri}]
  sandbox_image = "{pause_tag}"
  # This machine cannot lower oom_score_adj (no CAP_SYS_RESOURCE): keep what the parent has.
  restrict_oom_score_adj = true
  enable_selinux = false
  disable_apparmor = true
  stream_server_address = "127.0.0.1"
  [{cri}.containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [{cri}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{cri}.containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "{n.run / 'runc'}"
  [{cri}.cni]
    bin_dir = "{CNI_BIN}"
    conf_dir = "{n.var / 'cni'}"
    max_conf_num = 1
"""


def cni_config(n: NodePaths) -> dict:
    return {
        "cniVersion": "0.4.0",
        "name": n.name,
        "plugins": [
            {
                "type": "bridge",
                "bridge": "cni0",
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": node_pod_cidr(n.index)}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(n.var / "cni-ipam"),
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def cgroup_roots(n: NodePaths) -> list[Path]:
    """The node's cgroup root in each v1 hierarchy (and the unified one)."""
    return [h / n.name for h in sorted(CGROUP_FS.iterdir()) if h.is_dir()]


def prepare(n: NodePaths, pause_tag: str) -> Path:
    """Write containerd's config, the CNI config and the cgroup roots; return the config."""
    for d in (n.run, n.var / "cni", n.var / "kubelet", n.var / "volume-plugins",
              n.store / "containerd"):
        d.mkdir(parents=True, exist_ok=True)
    cfg = n.run / "containerd.toml"
    cfg.write_text(containerd_config(n, pause_tag))
    (n.var / "cni" / "10-shoal.conflist").write_text(json.dumps(cni_config(n), indent=2))
    (n.var / "resolv.conf").write_text("# no upstream resolvers: cluster DNS only\n")
    make_mount_namespace(n)
    for root in cgroup_roots(n):
        root.mkdir(exist_ok=True)
        if root.parent.name == "cpuset":
            for key in ("cpuset.cpus", "cpuset.mems"):
                if not (root / key).read_text().strip():
                    (root / key).write_text((root.parent / key).read_text())
    return cfg


def containerd_argv(n: NodePaths, cfg: Path) -> list[str]:
    return [*enter(n), "containerd", "--config", str(cfg)]


def kubelet_argv(n: NodePaths, kubelet_bin: Path, kubeconfig: Path, pause_tag: str) -> list[str]:
    return [
        *enter(n), str(kubelet_bin),
        "--kubeconfig", str(kubeconfig),
        "--hostname-override", n.name,
        "--node-ip", n.ip,
        "--container-runtime=remote",
        f"--container-runtime-endpoint=unix://{n.sock}",
        "--runtime-request-timeout=10m",
        "--cgroup-driver=cgroupfs",
        f"--cgroup-root=/{n.name}",
        "--fail-swap-on=false",
        f"--cluster-dns={HOST_IP}",
        f"--cluster-domain={CLUSTER_DOMAIN}",
        f"--resolv-conf={n.var / 'resolv.conf'}",
        f"--root-dir={n.var / 'kubelet'}",
        f"--cert-dir={n.var / 'kubelet' / 'pki'}",
        f"--volume-plugin-dir={n.var / 'volume-plugins'}",
        f"--pod-infra-container-image={pause_tag}",
        # Images are loaded by the harness, never pulled: never collect them.
        "--image-gc-high-threshold=100",
        "--image-gc-low-threshold=99",
        # Absolute floors, not shares: the nodes live on the host's disk, shared with everything
        # else (2% of a 252 GB disk is 5 GB). Crossing a disk threshold makes the kubelet taint
        # the node (nothing schedules for 5 minutes) and delete every unused image, which no
        # registry can bring back here.
        "--eviction-hard=memory.available<100Mi,nodefs.available<1Gi,imagefs.available<1Gi",
        "--serialize-image-pulls=false",
        # The API server calls the kubelet (logs, exec) without a client certificate.
        "--anonymous-auth=true",
        "--authorization-mode=AlwaysAllow",
        "--read-only-port=0",
        "--max-pods=60",
        "--v=1",
    ]


def kube_proxy_argv(n: NodePaths, proxy_bin: Path, kubeconfig: Path) -> list[str]:
    return [
        *nsenter(n.name), str(proxy_bin),
        "--kubeconfig", str(kubeconfig),
        "--hostname-override", n.name,
        "--bind-address", n.ip,
        "--cluster-cidr", POD_CIDR,
        "--proxy-mode", "iptables",
        # Service traffic is masqueraded to the node: replies return through the node that did
        # the DNAT even between pods on one bridge (no br_netfilter on this machine).
        "--masquerade-all=true",
        # Leave the host's (global) conntrack settings alone.
        "--conntrack-max-per-core=0",
        "--conntrack-min=0",
        "--conntrack-tcp-timeout-established=0",
        "--conntrack-tcp-timeout-close-wait=0",
        "--healthz-bind-address=127.0.0.1:10256",
        "--metrics-bind-address=127.0.0.1:10249",
        "--v=1",
    ]


def purge_containers(n: NodePaths) -> int:
    """Remove every container (and its task and snapshot) a killed run left in the node's
    store, so the kubelet starts from nothing; images stay."""
    base = [*enter(n), "ctr", "-a", str(n.sock), "-n", "k8s.io"]
    ids = run([*base, "containers", "ls", "-q"], check=False).stdout.decode().split()
    for cid in ids:
        run([*base, "tasks", "delete", "-f", cid], check=False)
        run([*base, "containers", "rm", cid], check=False)
    return len(ids)
