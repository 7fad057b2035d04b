"""Start, watch and stop a control plane: etcd + kube-apiserver + kube-controller-manager (and
kube-scheduler for the cluster with nodes).

Why: the operator's tests need a real API server (schema validation, watches, garbage
collection, the StatefulSet controller) and there is no cluster or kubelet on the test machines.
The binaries come from build.sh (cached under `$SHOAL_CACHE/k8s/bin`); etcd from Debian's
etcd-server.

Boundaries: everything listens on 127.0.0.1 (or the cluster's address) on free ports; all state
(etcd data, certificates, tokens, kubeconfig, logs) lives in one directory given by the caller.
Clients authenticate with a static bearer token (user `admin`, group `system:masters`). The
command lines are components.py's; the credentials pki.py's.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from shoal.devcluster import api
from shoal.devcluster.build import control_plane_built
from shoal.devcluster.components import (
    DEFAULT_CONTROLLERS,
    ControlPlaneConfig,
    apiserver_args,
    controller_manager_args,
    etcd_args,
    scheduler_args,
)
from shoal.devcluster.layout import BUILD_SCRIPT, bin_dir
from shoal.devcluster.pki import make_pki, write_kubeconfig, write_tokens
from shoal.devcluster.procs import DevClusterError, Process, free_port, pid_runs, tail

# In a detached supervisor's command line (`control-plane start DIR --foreground`).
SUPERVISOR = ("-m", "shoal.devcluster", "control-plane", "start")
STOP_ORDER = ("kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd")


class ControlPlaneError(DevClusterError):
    """Start-up or shutdown failed; the message names the component and quotes its log."""


@dataclass
class ControlPlane:
    """One control plane rooted at `root`. Use `start()`/`stop()` or as a context manager."""

    root: Path
    controllers: tuple[str, ...] = DEFAULT_CONTROLLERS
    tie_to_parent: bool = True  # kill children if this Python process dies
    etcd_port: int = 0
    server_port: int = 0
    token: str = ""
    components: list[Process] = field(default_factory=list)
    started_s: float = 0.0  # seconds from start() to API ready
    # The cluster with nodes (cluster.py) sets these: the API server on an address the nodes
    # reach, RBAC enforced, ServiceAccount tokens for pods, and a scheduler.
    address: str = "127.0.0.1"
    authorization_mode: str = "AlwaysAllow"
    service_accounts: bool = False
    scheduler: bool = False
    config: ControlPlaneConfig | None = None  # set by start()
    # component name -> its readiness check (start() fills it; `outage` waits on it)
    ready_checks: dict[str, Callable[[], bool]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.root = Path(self.root).resolve()

    # -- paths and addresses -------------------------------------------------------------------
    @property
    def server(self) -> str:
        return f"https://{self.address}:{self.server_port}"

    @property
    def kubeconfig(self) -> Path:
        return self.root / "kubeconfig"

    @property
    def ca_file(self) -> Path:
        return self.root / "pki" / "ca.crt"

    def env(self) -> dict[str, str]:
        """Environment for child processes (kubectl, kopf run) that should use this server."""
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig)}

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self, timeout: float = 120.0) -> ControlPlane:
        """Start each component in turn, each once the previous one is healthy."""
        t0 = time.monotonic()
        self.config = self._configure()
        try:
            for comp, ready in self._plan(self.config):
                self.components.append(comp)
                self.ready_checks[comp.name] = ready
                self._spawn(comp)
                self._wait(ready, comp, t0 + timeout)
        except BaseException:
            self.stop()
            raise
        self.started_s = time.monotonic() - t0
        self._write_state()
        return self

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM in reverse start order, SIGKILL after `grace` seconds; reaps every child."""
        for comp in reversed(self.components):
            comp.stop(grace)
        (self.root / "state.json").unlink(missing_ok=True)

    def outage(self, name: str, seconds: float, timeout: float = 120.0) -> dict:
        """Stop one component (SIGTERM, as an upgrade or a crash-restart does), keep it down for
        `seconds`, start it again with the same command line, and wait until it is ready."""
        comp = next((c for c in self.components if c.name == name), None)
        if comp is None:
            raise ControlPlaneError(f"no component {name!r}")
        t0 = time.monotonic()
        comp.stop()
        down = time.monotonic()
        time.sleep(seconds)
        self._spawn(comp)
        self._wait(self.ready_checks[name], comp, time.monotonic() + timeout)
        back = time.monotonic()
        self._write_state()  # its new pid, for stop_dir
        return {"component": name, "stopped_s": round(down - t0, 2),
                "down_s": round(back - down, 2),
                "ready_after_start_s": round(back - down - seconds, 2)}

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def check_alive(self) -> None:
        """Raise naming the component that died, with its log tail."""
        for comp in self.components:
            why = comp.exited()
            if why:
                raise ControlPlaneError(why)

    # -- internals -----------------------------------------------------------------------------
    def _configure(self) -> ControlPlaneConfig:
        """Check the binaries, pick the ports, write the credentials and kubeconfigs."""
        if not control_plane_built():
            raise ControlPlaneError(
                f"no kube-apiserver/kube-controller-manager in {bin_dir()}; run {BUILD_SCRIPT}")
        etcd = shutil.which("etcd")
        if etcd is None:
            raise ControlPlaneError("etcd not on PATH; run build.sh (installs etcd-server)")
        self.root.mkdir(parents=True, exist_ok=True)
        self.etcd_port = self.etcd_port or free_port()
        self.server_port = self.server_port or free_port()
        cfg = ControlPlaneConfig(
            root=self.root, bin_dir=bin_dir(), etcd=etcd, address=self.address,
            etcd_port=self.etcd_port, peer_port=free_port(), server_port=self.server_port,
            controller_manager_port=free_port(), scheduler_port=free_port(),
            controllers=tuple(self.controllers), authorization_mode=self.authorization_mode,
            service_accounts=self.service_accounts)
        make_pki(cfg.pki, (self.address,))
        self.token = self.token or secrets.token_hex(16)
        write_tokens(cfg.tokens_file, self.token)
        write_kubeconfig(self.kubeconfig, self.server, self.ca_file, self.token)
        write_kubeconfig(cfg.components_kubeconfig, self.server, self.ca_file, self.token,
                         user="kube-controller-manager")
        return cfg

    def _plan(self, c: ControlPlaneConfig) -> list[tuple[Process, Callable[[], bool]]]:
        """The components in start order, each with its readiness check."""
        def comp(name: str, argv: list[str]) -> Process:
            return Process(name, argv, self.root / "logs" / f"{name}.log")

        def healthz(port: int) -> Callable[[], bool]:
            return lambda: api.https_ok(f"https://127.0.0.1:{port}/healthz")

        plan = [
            (comp("etcd", etcd_args(c)), lambda: api.etcd_healthy(c.etcd_url)),
            (comp("kube-apiserver", apiserver_args(c)),
             lambda: api.https_ok(f"{self.server}/readyz", self.token, self.ca_file)),
            (comp("kube-controller-manager", controller_manager_args(c)),
             healthz(c.controller_manager_port)),
        ]
        if self.scheduler:
            plan.append((comp("kube-scheduler", scheduler_args(c)), healthz(c.scheduler_port)))
        return plan

    def _spawn(self, comp: Process) -> None:
        comp.start(cwd=self.root, tie_to_parent=self.tie_to_parent)

    def _wait(self, ready: Callable[[], bool], comp: Process, deadline: float) -> None:
        while True:
            self.check_alive()
            if ready():
                return
            if time.monotonic() > deadline:
                raise ControlPlaneError(f"{comp.name} not ready before the deadline; log "
                                        f"{comp.log}:\n{tail(comp.log)}")
            time.sleep(0.2)

    def _write_state(self) -> None:
        # "supervisor": the process that owns the components (a detached supervisor, or the
        # test session); written atomically because start_detached polls for this file.
        state = {
            "server": self.server,
            "token": self.token,
            "kubeconfig": str(self.kubeconfig),
            "started_s": round(self.started_s, 2),
            "supervisor": os.getpid(),
            "pids": {c.name: c.pid for c in self.components if c.pid},
        }
        tmp = self.root / "state.json.tmp"
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        os.replace(tmp, self.root / "state.json")


# -- detached (python -m shoal.devcluster control-plane start|stop DIR) ------------------------
def run_foreground(root: Path) -> int:
    """Start, then watch until SIGTERM/Ctrl-C; stops everything either way."""
    def on_sigterm(signum, frame):  # noqa: ARG001
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    cp = ControlPlane(root, tie_to_parent=True)
    try:
        cp.start()
        print(f"control plane up in {cp.started_s:.1f}s: {cp.server}", flush=True)
        print(f"  kubectl --kubeconfig {cp.kubeconfig} get ns", flush=True)
        while True:
            cp.check_alive()
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        cp.stop()
    return 0


def start_detached(root: Path, timeout: float = 180.0) -> int:
    """Run a supervisor (`start --foreground`) in its own session and wait until it is up."""
    root.mkdir(parents=True, exist_ok=True)
    sup_log = root / "supervisor.log"
    with open(sup_log, "ab") as out:
        sup = subprocess.Popen([sys.executable, *SUPERVISOR, str(root), "--foreground",
                                "--no-build"], stdin=subprocess.DEVNULL, stdout=out,
                               stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    state_file = root / "state.json"
    while not state_file.exists():
        if sup.poll() is not None:
            print(f"control plane failed to start (exit {sup.returncode}):\n"
                  f"{tail(sup_log, 30)}", file=sys.stderr)
            return 1
        if time.monotonic() > deadline:
            sup.terminate()
            print(f"control plane not up after {timeout:.0f}s; see {root / 'logs'}",
                  file=sys.stderr)
            return 1
        time.sleep(0.2)
    state = json.loads(state_file.read_text())
    print(f"control plane up in {state['started_s']:.1f}s: {state['server']} "
          f"(supervisor pid {sup.pid})")
    print(f"  kubectl --kubeconfig {state['kubeconfig']} get ns")
    print(f"  logs: {root / 'logs'}")
    print(f"  stop: python -m shoal.devcluster control-plane stop {root}")
    return 0


def _terminate(pid: int, needle: str, grace: float, kill: bool = True) -> None:
    """SIGTERM, wait up to `grace` seconds, then SIGKILL if `kill`."""
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while pid_runs(pid, needle) and time.monotonic() < deadline:
        time.sleep(0.1)
    if kill and pid_runs(pid, needle):
        os.kill(pid, signal.SIGKILL)


def stop_dir(root: Path, grace: float = 10.0) -> int:
    """Stop a control plane started detached in `root`; returns how many processes it stopped.

    The detached supervisor owns (and reaps) the components, so it is asked first; the component
    pids in state.json are the fallback if the supervisor is gone.
    """
    state_file = Path(root) / "state.json"
    if not state_file.exists():
        return 0
    state = json.loads(state_file.read_text())
    stopped = 0
    sup = state.get("supervisor")
    needle = " ".join(SUPERVISOR)
    if sup and pid_runs(sup, needle):
        _terminate(sup, needle, 3 * grace + 5, kill=False)  # it stops its components first
        stopped += 1
    for name in STOP_ORDER:
        pid = state["pids"].get(name)
        if pid is not None and pid_runs(pid, name):
            _terminate(pid, name, grace)
            stopped += 1
    state_file.unlink(missing_ok=True)
    return stopped
