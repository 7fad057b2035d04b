"""What every part of the local cluster shares: its addresses, its directories, and how it runs
commands and reports progress.

Addresses are private ranges that the host's routes do not use (the host has 192.0.2.0/24 and a
default route): the nodes' bridge 10.213.0.0/24, pods 10.214.N.0/24 on node N, Services
10.96.0.0/16 (the control plane's range). Only this harness's own bridge, namespaces and veths
carry them; the host's ip_forward is never touched.

Directories: state (kubeconfig, certificates, etcd, logs) under `$SHOAL_CACHE/cluster`; what must
not outlive a run (sockets, containerd state, kubelet roots, the model copy) under RUN_DIR and
VAR_DIR, removed by teardown; node image stores under `$SHOAL_CACHE/cluster-nodes` so a warm run
does not import the images again.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

BRIDGE = "shoalbr0"
BRIDGE_CIDR = "10.213.0.0/24"
HOST_IP = "10.213.0.1"  # the API server, DNS and the host end of every node
API_PORT = 6443
POD_CIDR = "10.214.0.0/16"
SERVICE_CIDR = "10.96.0.0/16"
NODE_NAMES = ("shoal-node1", "shoal-node2")


def node_ip(index: int) -> str:
    return f"10.213.0.{11 + index}"


def node_pod_cidr(index: int) -> str:
    return f"10.214.{1 + index}.0/24"


def netns_name(node: str) -> str:
    return node  # /run/netns/<node>


def cache_root() -> Path:
    return Path(os.environ.get("SHOAL_CACHE", Path.home() / ".cache" / "shoal"))


def state_dir() -> Path:
    return cache_root() / "cluster"


def node_store(node: str) -> Path:
    """Per-node containerd root (image content and snapshots): kept between runs."""
    return cache_root() / "cluster-nodes" / node


RUN_DIR = Path("/run/shoal-cluster")  # sockets, containerd state
VAR_DIR = Path("/var/lib/shoal-cluster")  # kubelet roots, CNI state, model copy
MODEL_HOST_DIR = VAR_DIR / "models"  # hostPath of the example's model volume

T0 = time.monotonic()


def log(msg: str) -> None:
    """One progress line on stderr, with the seconds since this process started."""
    print(f"[cluster +{time.monotonic() - T0:5.0f}s] {msg}", file=sys.stderr, flush=True)


class ClusterError(RuntimeError):
    """A step failed; the message says which and quotes what it printed."""


def run(argv: list[str], *, check: bool = True, input: bytes | None = None,
        timeout: float | None = None, quiet: bool = False, env: dict | None = None
        ) -> subprocess.CompletedProcess:
    res = subprocess.run(argv, input=input, capture_output=True, timeout=timeout, env=env)
    if check and res.returncode != 0:
        out = (res.stderr or b"").decode(errors="replace").strip()[-2000:]
        raise ClusterError(f"{' '.join(map(str, argv[:6]))} failed (exit {res.returncode}): {out}")
    if not quiet and res.returncode != 0:
        pass
    return res


def run_logged(argv: list[str], log_path: Path, *, what: str, env: dict | None = None,
               cwd: Path | None = None, heartbeat: float = 30.0) -> None:
    """Run a long step with its output in `log_path`; a progress line every `heartbeat` seconds
    (the log's last line), the log's tail in the error if it fails."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, env=env, cwd=cwd)
        next_beat = t0 + heartbeat
        while proc.poll() is None:
            time.sleep(0.5)
            if time.monotonic() >= next_beat:
                next_beat += heartbeat
                log(f"{what}: {time.monotonic() - t0:.0f}s ... {last_line(log_path)}")
    if proc.returncode != 0:
        raise ClusterError(f"{what} failed (exit {proc.returncode}); log {log_path}:\n"
                           f"{tail(log_path, 30)}")
    log(f"{what}: done in {time.monotonic() - t0:.0f}s")


def tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def last_line(path: Path) -> str:
    text = tail(path, 1).strip()
    return text[:140]
