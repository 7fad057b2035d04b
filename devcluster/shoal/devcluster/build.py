"""build.sh (Kubernetes from Debian's source, cached under `$SHOAL_CACHE/k8s`) from Python.

Sets: `control-plane` (kube-apiserver, kube-controller-manager: the operator's tests), `node`
(kubelet, kube-scheduler, kube-proxy, pause: the cluster with nodes), `all` (both from one
unpacked tree), `packages` (only the Debian packages the nodes and image builds need). Every
call is a no-op on a warm cache; a flock serialises concurrent callers.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

from shoal.devcluster.layout import BUILD_SCRIPT, bin_dir
from shoal.devcluster.procs import DevClusterError

CONTROL_PLANE_BINARIES = ("kube-apiserver", "kube-controller-manager")


def command(*sets: str) -> list[str]:
    return ["bash", str(BUILD_SCRIPT), *sets]


def control_plane_built() -> bool:
    return all((bin_dir() / b).is_file() for b in CONTROL_PLANE_BINARIES)


def run_build(*sets: str) -> None:
    """Build in the foreground, its output on this terminal."""
    proc = subprocess.run(command(*sets), stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise DevClusterError(f"{BUILD_SCRIPT} {' '.join(sets)} failed (exit {proc.returncode})")


def start_build(*sets: str) -> subprocess.Popen:
    """Build in the background (the cluster's images build meanwhile)."""
    return subprocess.Popen(command(*sets), stdin=subprocess.DEVNULL)


def ensure_built(log_path: Path, progress: Callable[[str], None] | None = None) -> None:
    """Build the control-plane set, output to `log_path`; `progress(line)` gets its
    "[k8s-build ...]" step lines. Raises with the last output lines on failure."""
    tail: list[str] = []
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace")
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            log.flush()
            tail = (tail + [line.rstrip("\n")])[-40:]
            if progress is not None and line.startswith("[k8s-build"):
                progress(line.rstrip("\n"))
        rc = proc.wait()
    if rc != 0:
        body = "\n".join(tail)
        raise DevClusterError(f"{BUILD_SCRIPT} failed (exit {rc}; log {log_path}):\n{body}")
