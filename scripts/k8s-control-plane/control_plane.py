"""Start and stop a local Kubernetes control plane: etcd + kube-apiserver + kube-controller-manager.

Why: the operator's tests need a real API server (schema validation, watches, garbage collection,
the StatefulSet controller) and there is no cluster or kubelet on the test machines. The binaries
come from `build.sh` (cached under `$SHOAL_CACHE/k8s/bin`); etcd from Debian's etcd-server.

Boundaries: everything listens on 127.0.0.1 on free ports; all state (etcd data, certificates,
tokens, kubeconfig, logs) lives in one directory given by the caller. Clients authenticate with a
static bearer token (user `admin`, group `system:masters`) and every request is allowed
(`--authorization-mode=AlwaysAllow`). There is no kubelet or scheduler: pods stay Pending unless a
test patches their status (see tests/support/kubelet.py).

Stdlib only, so that it runs from a bare python3 (start.sh) as well as inside pytest.

CLI:  python3 control_plane.py start DIR [--foreground]   |   python3 control_plane.py stop DIR
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
BUILD_SCRIPT = HERE / "build.sh"

DEFAULT_CONTROLLERS = ("garbagecollector", "deployment", "replicaset", "statefulset", "namespace")
SERVICE_CIDR = "10.96.0.0/16"


def cache_dir() -> Path:
    return Path(os.environ.get("SHOAL_CACHE", Path.home() / ".cache" / "shoal")) / "k8s"


def bin_dir() -> Path:
    return cache_dir() / "bin"


def binaries_present() -> bool:
    return all((bin_dir() / b).is_file() for b in ("kube-apiserver", "kube-controller-manager"))


class ControlPlaneError(RuntimeError):
    """Start-up or shutdown failed; the message names the component and quotes its log."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


def _die_with_parent() -> None:
    """preexec_fn: SIGTERM the child when the starting process dies (no strays after a crash)."""
    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def _openssl(*args: str, cwd: Path) -> None:
    res = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if res.returncode != 0:
        raise ControlPlaneError(f"openssl {' '.join(args[:2])} failed: {res.stderr.strip()}")


def make_pki(pki: Path, extra_ips: tuple[str, ...] = ()) -> None:
    """CA, serving certificate for 127.0.0.1/localhost (and `extra_ips`), and the
    service-account key pair."""
    pki.mkdir(parents=True, exist_ok=True)
    if (pki / "apiserver.crt").is_file() and (pki / "sa.pub").is_file():
        return
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "3650",
        "-subj",
        "/CN=shoal-test-ca",
        cwd=pki,
    )
    _openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "apiserver.key",
        "-out",
        "apiserver.csr",
        "-subj",
        "/CN=kube-apiserver",
        cwd=pki,
    )
    ips = "".join(f"IP:{ip}," for ip in extra_ips if ip != "127.0.0.1")
    (pki / "san.ext").write_text(
        f"subjectAltName=IP:127.0.0.1,{ips}IP:10.96.0.1,DNS:localhost,DNS:kubernetes,"
        "DNS:kubernetes.default,DNS:kubernetes.default.svc\n"
        "extendedKeyUsage=serverAuth\nkeyUsage=digitalSignature,keyEncipherment\n"
    )
    _openssl(
        "x509",
        "-req",
        "-in",
        "apiserver.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "apiserver.crt",
        "-days",
        "3650",
        "-extfile",
        "san.ext",
        cwd=pki,
    )
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=pki)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)


def write_kubeconfig(path: Path, server: str, ca: Path, token: str, user: str = "admin") -> None:
    # JSON is valid YAML: kubectl, kopf and the Python client all read it.
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "shoal-test", "cluster": {"server": server, "certificate-authority": str(ca)}}
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [
            {
                "name": "shoal-test",
                "context": {"cluster": "shoal-test", "user": user, "namespace": "default"},
            }
        ],
        "current-context": "shoal-test",
    }
    path.write_text(json.dumps(cfg, indent=2) + "\n")
    path.chmod(0o600)


@dataclass
class Component:
    name: str
    argv: list[str]
    log: Path
    proc: subprocess.Popen | None = None


@dataclass
class ControlPlane:
    """One control plane rooted at `root`. Use `start()`/`stop()` or as a context manager."""

    root: Path
    controllers: tuple[str, ...] = DEFAULT_CONTROLLERS
    tie_to_parent: bool = True  # kill children if this Python process dies
    etcd_port: int = 0
    server_port: int = 0
    token: str = ""
    components: list[Component] = field(default_factory=list)
    started_s: float = 0.0  # seconds from start() to API ready
    # A cluster with nodes (cluster.py) sets these: the API server on an address the nodes
    # reach, RBAC enforced, ServiceAccount tokens for pods, and a scheduler.
    address: str = "127.0.0.1"
    authorization_mode: str = "AlwaysAllow"
    service_accounts: bool = False
    scheduler: bool = False

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
        if not binaries_present():
            raise ControlPlaneError(
                f"no kube-apiserver/kube-controller-manager in {bin_dir()}; run {BUILD_SCRIPT}"
            )
        etcd = shutil.which("etcd")
        if etcd is None:
            raise ControlPlaneError("etcd not on PATH; run build.sh (installs etcd-server)")
        t0 = time.monotonic()
        self.root.mkdir(parents=True, exist_ok=True)
        logs = self.root / "logs"
        logs.mkdir(exist_ok=True)
        pki = self.root / "pki"
        make_pki(pki, (self.address,))
        self.token = self.token or secrets.token_hex(16)
        (self.root / "tokens.csv").write_text(f'{self.token},admin,admin,"system:masters"\n')
        self.etcd_port = self.etcd_port or free_port()
        self.server_port = self.server_port or free_port()
        peer_port = free_port()
        write_kubeconfig(self.kubeconfig, self.server, self.ca_file, self.token)

        etcd_url = f"http://127.0.0.1:{self.etcd_port}"
        peer_url = f"http://127.0.0.1:{peer_port}"
        self.components = [
            Component(
                "etcd",
                [
                    etcd,
                    "--name",
                    "shoal-test",
                    "--data-dir",
                    str(self.root / "etcd"),
                    "--listen-client-urls",
                    etcd_url,
                    "--advertise-client-urls",
                    etcd_url,
                    "--listen-peer-urls",
                    peer_url,
                    "--initial-advertise-peer-urls",
                    peer_url,
                    "--initial-cluster",
                    f"shoal-test={peer_url}",
                    "--logger",
                    "zap",
                    "--log-level",
                    "warn",
                    "--quota-backend-bytes",
                    str(2 * 1024**3),
                ],
                logs / "etcd.log",
            ),
            Component(
                "kube-apiserver",
                [
                    str(bin_dir() / "kube-apiserver"),
                    "--etcd-servers",
                    etcd_url,
                    "--bind-address",
                    self.address,
                    "--advertise-address",
                    self.address,
                    "--secure-port",
                    str(self.server_port),
                    "--tls-cert-file",
                    str(pki / "apiserver.crt"),
                    "--tls-private-key-file",
                    str(pki / "apiserver.key"),
                    "--client-ca-file",
                    str(pki / "ca.crt"),
                    # Front-proxy CA: published in kube-system/extension-apiserver-authentication,
                    # which the controller manager's delegated authn otherwise complains about.
                    "--requestheader-client-ca-file",
                    str(pki / "ca.crt"),
                    "--requestheader-allowed-names",
                    "front-proxy-client",
                    "--requestheader-username-headers",
                    "X-Remote-User",
                    "--requestheader-group-headers",
                    "X-Remote-Group",
                    "--requestheader-extra-headers-prefix",
                    "X-Remote-Extra-",
                    "--token-auth-file",
                    str(self.root / "tokens.csv"),
                    "--authorization-mode",
                    self.authorization_mode,
                    "--service-account-key-file",
                    str(pki / "sa.pub"),
                    "--service-account-signing-key-file",
                    str(pki / "sa.key"),
                    "--service-account-issuer",
                    "https://kubernetes.default.svc.cluster.local",
                    "--service-cluster-ip-range",
                    SERVICE_CIDR,
                    "--allow-privileged=true",
                    # Nodes (cluster.py) are reached by their InternalIP: their names resolve
                    # nowhere.
                    "--kubelet-preferred-address-types",
                    "InternalIP,ExternalIP,Hostname",
                    *(
                        []
                        if self.service_accounts
                        else [
                            # No token controller runs, so ServiceAccount admission would reject
                            # every pod ("no API token found"); pods run nowhere anyway.
                            "--disable-admission-plugins",
                            "ServiceAccount",
                            "--endpoint-reconciler-type",
                            "none",
                        ]
                    ),
                    "--v",
                    "1",
                ],
                logs / "kube-apiserver.log",
            ),
        ]
        try:
            self._spawn(self.components[0])
            self._wait(lambda: self._etcd_healthy(etcd_url), "etcd", t0 + timeout)
            self._spawn(self.components[1])
            self._wait(self._api_ready, "kube-apiserver", t0 + timeout)
            kcm_port = free_port()
            kcm_kubeconfig = self.root / "kube-controller-manager.kubeconfig"
            write_kubeconfig(
                kcm_kubeconfig,
                self.server,
                self.ca_file,
                self.token,
                user="kube-controller-manager",
            )
            kcm = Component(
                "kube-controller-manager",
                [
                    str(bin_dir() / "kube-controller-manager"),
                    "--kubeconfig",
                    str(kcm_kubeconfig),
                    "--authentication-kubeconfig",
                    str(kcm_kubeconfig),
                    "--authorization-kubeconfig",
                    str(kcm_kubeconfig),
                    "--controllers",
                    ",".join(self.controllers),
                    "--bind-address",
                    "127.0.0.1",
                    "--secure-port",
                    str(kcm_port),
                    "--port",
                    "0",
                    "--cert-dir",
                    str(self.root / "kcm-certs"),
                    "--leader-elect=false",
                    "--use-service-account-credentials=false",
                    "--service-account-private-key-file",
                    str(pki / "sa.key"),
                    "--root-ca-file",
                    str(pki / "ca.crt"),
                    "--concurrent-statefulset-syncs",
                    "10",
                    "--concurrent-gc-syncs",
                    "20",
                    "--v",
                    "1",
                ],
                logs / "kube-controller-manager.log",
            )
            self.components.append(kcm)
            self._spawn(kcm)
            self._wait(
                lambda: self._https_ok(f"https://127.0.0.1:{kcm_port}/healthz", None),
                "kube-controller-manager",
                t0 + timeout,
            )
            if self.scheduler:
                self._start_scheduler(kcm_kubeconfig, t0 + timeout)
        except BaseException:
            self.stop()
            raise
        self.started_s = time.monotonic() - t0
        self._write_state()
        return self

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM in reverse start order, SIGKILL after `grace` seconds; reaps every child."""
        for comp in reversed(self.components):
            p = comp.proc
            if p is None or p.poll() is not None:
                continue
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(grace)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        state = self.root / "state.json"
        if state.exists():
            state.unlink()

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def check_alive(self) -> None:
        """Raise naming the component that died, with its log tail."""
        for comp in self.components:
            if comp.proc is not None and comp.proc.poll() is not None:
                raise ControlPlaneError(
                    f"{comp.name} exited with code {comp.proc.returncode}; log {comp.log}:\n"
                    f"{_log_tail(comp.log)}"
                )

    # -- internals -----------------------------------------------------------------------------
    def _start_scheduler(self, kubeconfig: Path, deadline: float) -> None:
        port = free_port()
        comp = Component(
            "kube-scheduler",
            [
                str(bin_dir() / "kube-scheduler"),
                "--kubeconfig",
                str(kubeconfig),
                "--authentication-kubeconfig",
                str(kubeconfig),
                "--authorization-kubeconfig",
                str(kubeconfig),
                "--bind-address",
                "127.0.0.1",
                "--secure-port",
                str(port),
                "--port",
                "0",
                "--leader-elect=false",
                "--v",
                "1",
            ],
            self.root / "logs" / "kube-scheduler.log",
        )
        self.components.append(comp)
        self._spawn(comp)
        self._wait(
            lambda: self._https_ok(f"https://127.0.0.1:{port}/healthz", None),
            "kube-scheduler",
            deadline,
        )

    def _spawn(self, comp: Component) -> None:
        log = open(comp.log, "ab")
        try:
            comp.proc = subprocess.Popen(
                comp.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.root,
                start_new_session=True,
                preexec_fn=_die_with_parent if self.tie_to_parent else None,
            )
        finally:
            log.close()

    def _wait(self, ready, what: str, deadline: float) -> None:
        while True:
            self.check_alive()
            if ready():
                return
            if time.monotonic() > deadline:
                comp = next(c for c in self.components if c.name == what)
                raise ControlPlaneError(
                    f"{what} not ready before the deadline; log {comp.log}:\n{_log_tail(comp.log)}"
                )
            time.sleep(0.2)

    def _ssl_context(self, verify: bool) -> ssl.SSLContext:
        if verify:
            return ssl.create_default_context(cafile=str(self.ca_file))
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return ctx

    def _https_ok(self, url: str, token: str | None, verify: bool = False) -> bool:
        req = urllib.request.Request(url)
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req, timeout=2, context=self._ssl_context(verify)) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _api_ready(self) -> bool:
        return self._https_ok(f"{self.server}/readyz", self.token, verify=True)

    @staticmethod
    def _etcd_healthy(url: str) -> bool:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                return json.load(r).get("health") == "true"
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def _write_state(self) -> None:
        # "supervisor": the process that owns the components (start.sh's detached supervisor,
        # or the test session); written atomically because start.sh polls for this file.
        state = {
            "server": self.server,
            "token": self.token,
            "kubeconfig": str(self.kubeconfig),
            "started_s": round(self.started_s, 2),
            "supervisor": os.getpid(),
            "pids": {c.name: c.proc.pid for c in self.components if c.proc},
        }
        tmp = self.root / "state.json.tmp"
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        os.replace(tmp, self.root / "state.json")


def ensure_built(log_path: Path, progress=None) -> None:
    """Run build.sh (a no-op on a warm cache), output to `log_path`; `progress(line)` gets its
    "[k8s-build ...]" step lines. Raises with the last output lines on failure."""
    tail: list[str] = []
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            ["bash", str(BUILD_SCRIPT)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
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
        raise ControlPlaneError(f"{BUILD_SCRIPT} failed (exit {rc}; log {log_path}):\n{body}")


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
    if sup and _pid_runs(sup, "control_plane.py"):
        os.kill(sup, signal.SIGTERM)
        deadline = time.monotonic() + 3 * grace + 5
        while _pid_runs(sup, "control_plane.py") and time.monotonic() < deadline:
            time.sleep(0.1)
        stopped += 1
    for name in ("kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"):
        pid = state["pids"].get(name)
        if pid is None or not _pid_runs(pid, name):
            continue
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while _pid_runs(pid, name) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _pid_runs(pid, name):
            os.kill(pid, signal.SIGKILL)
        stopped += 1
    if state_file.exists():
        state_file.unlink()
    return stopped


def _pid_runs(pid: int, needle: str) -> bool:
    """True if `pid` is alive (not a zombie) and its command line mentions `needle` (guards
    against reused pids)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return needle in cmdline and stat.split(") ")[-1][:1] != "Z"


def _start_detached(root: Path, timeout: float = 180.0) -> int:
    """Run a supervisor (`start --foreground`) in its own session and wait until it is up."""
    root.mkdir(parents=True, exist_ok=True)
    log = open(root / "supervisor.log", "ab")
    sup = subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).resolve()),
            "start",
            str(root),
            "--foreground",
            "--no-build",
        ],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    log.close()
    deadline = time.monotonic() + timeout
    state_file = root / "state.json"
    while not state_file.exists():
        if sup.poll() is not None:
            print(
                f"control plane failed to start (exit {sup.returncode}):\n"
                f"{_log_tail(root / 'supervisor.log', 30)}",
                file=sys.stderr,
            )
            return 1
        if time.monotonic() > deadline:
            sup.terminate()
            print(
                f"control plane not up after {timeout:.0f}s; see {root / 'logs'}", file=sys.stderr
            )
            return 1
        time.sleep(0.2)
    state = json.loads(state_file.read_text())
    print(
        f"control plane up in {state['started_s']:.1f}s: {state['server']} "
        f"(supervisor pid {sup.pid})"
    )
    print(f"  kubectl --kubeconfig {state['kubeconfig']} get ns")
    print(f"  logs: {root / 'logs'}")
    print(f"  stop: {HERE / 'start.sh'} --stop {root}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("start", help="start a control plane with its state in DIR")
    st.add_argument("dir", type=Path)
    st.add_argument(
        "--foreground", action="store_true", help="stay attached; Ctrl-C/SIGTERM stops everything"
    )
    st.add_argument("--no-build", action="store_true", help="fail instead of running build.sh")
    sp = sub.add_parser("stop", help="stop the control plane started detached in DIR")
    sp.add_argument("dir", type=Path)
    args = ap.parse_args(argv)
    root = args.dir.resolve()

    if args.cmd == "stop":
        n = stop_dir(root)
        print(f"stopped {n} process(es)" if n else f"nothing running in {root}")
        return 0

    if (root / "state.json").exists():
        print(f"{root} already has a running control plane; stop it first", file=sys.stderr)
        return 1
    if not args.no_build and not binaries_present():
        print(
            f"building the control plane ({BUILD_SCRIPT}); first build takes ~10-20 min",
            file=sys.stderr,
        )
        subprocess.run(["bash", str(BUILD_SCRIPT)], check=True)
    if not args.foreground:
        return _start_detached(root)

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


if __name__ == "__main__":
    sys.exit(main())
