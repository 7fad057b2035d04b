"""One node's host side: its directories, configuration files, mount namespace and cgroup roots.

A node is containerd + runc + kubelet + kube-proxy inside the node's network namespace (their
command lines: components.py). They share the host's mount namespace through a slave of it, so
their mounts (container root filesystems, pod volumes) are cleaned by teardown.

Per node: containerd's image store under `$SHOAL_CACHE/cluster-nodes/NODE` (kept: a warm run
does not import images again), its state and sockets under RUN_DIR/NODE, the kubelet's root and
the CNI configuration under VAR_DIR/NODE, and its own cgroup root `/NODE` (two kubelets must not
share `/kubepods`).
"""

from __future__ import annotations

import json
from pathlib import Path

from shoal.devcluster.components import cni_config, containerd_config, nsenter_node
from shoal.devcluster.layout import NodeLayout
from shoal.devcluster.procs import run

CGROUP_FS = Path("/sys/fs/cgroup")
# Fixed paths in the kubelet (no flag): each node gets its own, bind-mounted in its namespace.
PRIVATE_DIRS = ("/var/log/pods", "/var/log/containers", "/var/lib/kubelet/device-plugins")


def make_mount_namespace(n: NodeLayout) -> None:
    """A mount namespace of the node's own (slave of the host's), held by a file, in which its
    containerd and kubelet run. Why: the kubelet's log directories are fixed paths, and each
    kubelet's garbage collector deletes the directories of pods it does not know, i.e. the other
    node's pods (whose `kubectl logs` and FallbackToLogsOnError termination messages then fail),
    and both would register their device plugins at one socket. Here each node has its own
    directories, bind-mounted over those paths. The node's mounts (container root filesystems,
    volumes) stay in it and go when it does."""
    holder = n.mntns.parent
    holder.mkdir(parents=True, exist_ok=True)
    run(["mount", "--bind", str(holder), str(holder)])
    run(["mount", "--make-private", str(holder)])
    n.mntns.touch()
    run(["unshare", f"--mount={n.mntns}", "--propagation", "slave", "true"])
    for path in PRIVATE_DIRS:
        own = n.var / "private" / path.strip("/").replace("/", "_")
        own.mkdir(parents=True, exist_ok=True)
        Path(path).mkdir(parents=True, exist_ok=True)
        run(["nsenter", f"--mount={n.mntns}", "mount", "--bind", str(own), path])


def cgroup_roots(n: NodeLayout) -> list[Path]:
    """The node's cgroup root in each v1 hierarchy (and the unified one)."""
    return [h / n.name for h in sorted(CGROUP_FS.iterdir()) if h.is_dir()]


def prepare(n: NodeLayout, pause_tag: str) -> Path:
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


def containerd_ok(n: NodeLayout) -> bool:
    return n.sock.exists() and run(["ctr", "-a", str(n.sock), "version"],
                                   check=False).returncode == 0


def purge_containers(n: NodeLayout) -> int:
    """Remove every container (and its task and snapshot) a killed run left in the node's
    store, so the kubelet starts from nothing; images stay."""
    base = [*nsenter_node(n), "ctr", "-a", str(n.sock), "-n", "k8s.io"]
    ids = run([*base, "containers", "ls", "-q"], check=False).stdout.decode().split()
    for cid in ids:
        run([*base, "tasks", "delete", "-f", cid], check=False)
        run([*base, "containers", "rm", cid], check=False)
    return len(ids)
