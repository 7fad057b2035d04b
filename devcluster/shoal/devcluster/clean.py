"""Remove everything a cluster run leaves on the host, whether it stopped cleanly or was killed:
processes, mounts, cgroups, the network, and the host paths a kubelet/containerd write even
with custom roots (/var/log/pods, /var/log/containers, /var/lib/kubelet/device-plugins,
/run/containerd, /var/lib/cni, pod network namespaces under /run/netns).

Every step is idempotent and tolerates missing pieces, so it runs before each start too.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

from shoal.devcluster import net
from shoal.devcluster.layout import NODE_NAMES, RUN_DIR, VAR_DIR, node_store, state_dir
from shoal.devcluster.node import CGROUP_FS
from shoal.devcluster.procs import log, run

# Written by kubelet/containerd/CNI at fixed places; nothing else on these machines uses them.
HOST_PATHS = (Path("/var/log/pods"), Path("/var/log/containers"),
              Path("/var/lib/kubelet"), Path("/run/containerd"), Path("/var/lib/cni"))
OUR_PREFIXES = (str(RUN_DIR), str(VAR_DIR))


def _node_cgroup_dirs() -> list[Path]:
    out = []
    for node in NODE_NAMES:
        for h in CGROUP_FS.iterdir():
            if (h / node).is_dir():
                out.append(h / node)
    return out


def procs_in(cg: Path) -> set[int]:
    pids: set[int] = set()
    for f in cg.rglob("cgroup.procs"):
        try:
            pids |= {int(x) for x in f.read_text().split()}
        except OSError:
            pass
    return pids


def our_processes() -> set[int]:
    """Processes started from our paths (containerd, shims, kubelets, kube-proxies) and every
    process inside the nodes' cgroups (containers); never this package's own commands."""
    pids: set[int] = set()
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        ours = any(p in cmd for p in (*OUR_PREFIXES, f"{state_dir()}/"))
        if ours and "shoal.devcluster" not in cmd:
            pids.add(int(entry.name))
    for cg in _node_cgroup_dirs():
        pids |= procs_in(cg)
    pids.discard(me)
    return pids


def kill_processes(timeout: float = 10.0) -> int:
    pids = our_processes()
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while our_processes() and time.monotonic() < deadline:
        for pid in our_processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
    return len(pids)


def _mounts() -> list[str]:
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        points.append(point)
    return points


def release_mount_namespaces() -> None:
    """Unmount the files holding the nodes' mount namespaces: with no process left in them,
    the kernel then drops every mount made inside."""
    for node in NODE_NAMES:
        holder = RUN_DIR / node / "ns"
        for target in (holder / "mnt", holder):
            run(["umount", "-l", str(target)], check=False)


def _ours(point: str) -> bool:
    prefixes = (*OUR_PREFIXES, *(str(node_store(n)) for n in NODE_NAMES),
                "/run/netns/cni-", "/var/run/netns/cni-", "/run/containerd/", "/var/lib/kubelet/",
                *(f"/run/netns/{n}" for n in NODE_NAMES))
    return point.startswith(prefixes)


def unmount_all() -> int:
    n = 0
    for _ in range(5):
        points = sorted({p for p in _mounts() if _ours(p)}, key=len, reverse=True)
        if not points:
            break
        for p in points:
            if run(["umount", "-l", p], check=False).returncode == 0:
                n += 1
    return n


def remove_cgroups() -> None:
    for cg in _node_cgroup_dirs():
        for d in sorted((p for p in cg.rglob("*") if p.is_dir()), key=lambda p: len(p.parts),
                        reverse=True):
            try:
                d.rmdir()
            except OSError:
                pass
        try:
            cg.rmdir()
        except OSError as exc:
            log(f"cleanup: cannot remove cgroup {cg}: {exc}")


def remove_paths() -> None:
    for netns in Path("/run/netns").glob("cni-*") if Path("/run/netns").is_dir() else []:
        netns.unlink(missing_ok=True)
    for p in (RUN_DIR, VAR_DIR, *HOST_PATHS, Path("/run/shoal-buildah")):
        shutil.rmtree(p, ignore_errors=True)
    netns_dir = Path("/run/netns")  # made (and bind-mounted on itself) by `ip netns add`
    if netns_dir.is_dir() and not any(netns_dir.iterdir()):
        run(["umount", str(netns_dir)], check=False)
        try:
            netns_dir.rmdir()
        except OSError:
            pass
    for node in NODE_NAMES:  # containers and their snapshots go; image content stays
        meta = node_store(node) / "containerd"
        for sub in ("io.containerd.grpc.v1.cri/containers", "io.containerd.grpc.v1.cri/sandboxes"):
            shutil.rmtree(meta / sub, ignore_errors=True)


def clean_all(quiet: bool = False) -> list[str]:
    """Tear down whatever is there; return what could not be removed (empty when clean)."""
    from shoal.devcluster.freeze import thaw_all

    thaw_all()  # a frozen container cannot die (a node-loss test that did not end well)
    killed = kill_processes()
    release_mount_namespaces()
    unmounted = unmount_all()
    remove_cgroups()
    net.teardown()
    remove_paths()
    left = leftovers()
    if not quiet or killed or unmounted:
        log(f"cleanup: killed {killed} process(es), unmounted {unmounted}; "
            + ("host clean" if not left else f"LEFT: {left}"))
    return left


def leftovers() -> list[str]:
    left = net.leftovers()
    left += [f"process {pid}" for pid in our_processes()]
    left += [f"mount {p}" for p in _mounts() if _ours(p)]
    left += [f"cgroup {c}" for c in _node_cgroup_dirs()]
    left += [f"path {p}" for p in (RUN_DIR, VAR_DIR) if p.exists()]
    return left
