"""The chart's RBAC is enough for the real operator, and nothing else is needed.

The suite's control plane authorizes everything (AlwaysAllow), so there the chart's Roles are
only stored, never tested. Here a second, private control plane runs the same binaries with
`--authorization-mode=RBAC`, and the real `shoal-operator` runs with the chart's arguments as the
chart's ServiceAccount (a static token for that identity): if RULES lacked a verb the operator
uses, the reconcile below would not finish and the operator's log would show the 403.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from packaging_support import CHART, EXAMPLES
from support.control_plane import cpmod
from support.k8s_tools import KubeCli
from support.wait import wait_for

pytestmark = pytest.mark.k8s

RELEASE_NS = "shoal-system"
SA = "system:serviceaccount:{ns}:{name}"


class RbacControlPlane(cpmod.ControlPlane):
    """The suite's control plane with RBAC enforced, plus static tokens for ServiceAccounts."""

    identities: dict[str, str] = {}  # token -> ServiceAccount username

    def _spawn(self, comp) -> None:
        if comp.name == "kube-apiserver":
            i = comp.argv.index("--authorization-mode")
            comp.argv[i + 1] = "RBAC"
            with open(self.root / "tokens.csv", "a") as f:
                for token, user in self.identities.items():
                    ns = user.split(":")[2]
                    f.write(f'{token},{user},{token[:8]},"system:serviceaccounts,system:serviceaccounts:{ns}"\n')
        super()._spawn(comp)


@pytest.fixture(scope="module")
def rbac_plane(tmp_path_factory, control_plane):
    """A private RBAC-enforcing control plane (control_plane first: it builds the binaries)."""
    root = tmp_path_factory.mktemp("rbac-plane")
    cp = RbacControlPlane(root, controllers=("serviceaccount",))
    cp.identities = {}
    tokens = {}
    for release_ns in ("shoal-system", "shoal-ns"):
        token = os.urandom(16).hex()
        cp.identities[token] = SA.format(ns=release_ns, name="shoal-operator")
        tokens[release_ns] = token
    try:
        cp.start(timeout=180)
    except cpmod.ControlPlaneError as exc:
        pytest.fail(f"RBAC control plane did not start: {exc}", pytrace=False)
    cp.sa_tokens = tokens
    yield cp
    cp.stop()


class Env(KubeCli):
    def __init__(self, cp, tools, home: Path):
        super().__init__(tools, cp.kubeconfig, home)
        self.cp = cp

    def sa_kubeconfig(self, release_ns: str) -> Path:
        path = self.home / f"{release_ns}.kubeconfig"
        cpmod.write_kubeconfig(path, self.cp.server, self.cp.ca_file, self.cp.sa_tokens[release_ns],
                               user="shoal-operator")
        return path


@pytest.fixture(scope="module")
def env(rbac_plane, k8s_tools, tmp_path_factory):
    return Env(rbac_plane, k8s_tools, tmp_path_factory.mktemp("rbac-env"))


class Operator:
    """`shoal-operator` with the args of the chart's Deployment, as the chart's ServiceAccount."""

    def __init__(self, env: Env, release_ns: str):
        dep = env.get("deployment", "shoal-operator", "-n", release_ns)
        assert dep, "the chart's Deployment"
        container = dep["spec"]["template"]["spec"]["containers"][0]
        port, metrics_port = cpmod.free_port(), cpmod.free_port()
        self.health = f"http://127.0.0.1:{port}/healthz"
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        ports = {"--liveness=": f"--liveness={self.health}",
                 "--metrics-port=": f"--metrics-port={metrics_port}"}
        self.args = [next((v for k, v in ports.items() if a.startswith(k)), a)
                     for a in container["args"]]
        self.log = env.home / f"operator-{release_ns}.log"
        exe = Path(sys.executable).with_name("shoal-operator")
        child_env = {**os.environ, "KUBECONFIG": str(env.sa_kubeconfig(release_ns))}
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([exe, *self.args], env=child_env, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def alive_and_healthy(self) -> bool:
        assert self.proc.poll() is None, \
            f"shoal-operator exited {self.proc.returncode}:\n{self.tail()}"
        try:
            with urllib.request.urlopen(self.health, timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def engine_series(self, ns: str, name: str) -> list[str]:
        """The lines of the operator's /metrics about one InferenceEngine."""
        with urllib.request.urlopen(self.metrics_url, timeout=5) as r:
            text = r.read().decode()
        assert "shoal_operator_build_info{" in text, text[:2000]
        return [line for line in text.splitlines()
                if f'inference_engine="{name}"' in line and f'namespace="{ns}"' in line]

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def forbidden(self) -> list[str]:
        denied = re.compile(r"forbidden|status=403|'code': 403", re.IGNORECASE)
        return [line for line in self.log.read_text(errors="replace").splitlines()
                if denied.search(line)]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


def reconciled(env: Env, ns: str, name: str):
    """Every child exists and status was written: the operator got through one full pass."""
    ie = env.get("ie", name, "-n", ns)
    if not ie or not (ie.get("status") or {}).get("phase"):
        return None
    for kind, obj in [("deployment", f"{name}-frontend"), ("service", name),
                      ("service", f"{name}-ranks"), ("configmap", f"{name}-engines"),
                      ("pod", f"{name}-g0-r0")]:
        if env.get(kind, obj, "-n", ns) is None:
            return None
    return ie


def run_operator_against(env: Env, release_ns: str, watched: str, unwatched: str | None = None):
    env.kubectl("apply", "-n", watched, "-f", EXAMPLES / "cpu-single.yaml")
    if unwatched:
        env.kubectl("apply", "-n", unwatched, "-f", EXAMPLES / "cpu-single.yaml")
    op = Operator(env, release_ns)
    try:
        wait_for(op.alive_and_healthy, timeout=60, interval=0.2,
                 what="the operator's liveness endpoint")
        ie = wait_for(lambda: reconciled(env, watched, "shoal-tiny"), timeout=90, interval=0.5,
                      what=f"the operator to create every child of {watched}/shoal-tiny "
                           "and write status")
        assert ie["status"]["phase"] in ("Pending", "Progressing"), ie["status"]
        # The pass's status is on the operator's /metrics (the chart's metrics port).
        series = wait_for(lambda: op.engine_series(watched, "shoal-tiny"), timeout=30,
                          interval=0.5, what="the engine's series on the operator's /metrics")
        assert 'shoal_engine_groups_desired{inference_engine="shoal-tiny",namespace="' \
            f'{watched}"}} 1.0' in series, series
        if unwatched:
            pods = env.get("pods", "-n", unwatched)
            assert pods["items"] == [], "an unwatched namespace was reconciled"
        env.kubectl("delete", "ie", "shoal-tiny", "-n", watched, "--wait=false")
        wait_for(lambda: env.get("ie", "shoal-tiny", "-n", watched) is None, timeout=90,
                 interval=0.5, what="the operator to stop the group and remove its finalizer")
        assert op.engine_series(watched, "shoal-tiny") == [], "a deleted engine kept series"
        assert op.forbidden() == [], "\n".join(op.forbidden())
    except BaseException:
        print(f"--- operator log ({op.log}):\n{op.tail()}")
        raise
    finally:
        op.stop()


def test_cluster_wide_chart_rbac_is_enough_for_the_operator(env):
    env.kubectl("create", "namespace", "team-a")
    env.helm("install", "shoal", CHART, "--namespace", RELEASE_NS, "--create-namespace")
    try:
        run_operator_against(env, RELEASE_NS, "team-a")
    finally:
        env.helm("uninstall", "shoal", "--namespace", RELEASE_NS)


def test_namespaced_chart_rbac_is_enough_for_the_operator(env):
    for ns in ("team-b", "team-c"):
        env.kubectl("create", "namespace", ns)
    env.helm("install", "shoal", CHART, "--namespace", "shoal-ns", "--create-namespace",
             "--set", "watchNamespaces={team-b}")
    try:
        # The ServiceAccount may not even read the unwatched namespace.
        denied = env.kubectl("--kubeconfig", env.sa_kubeconfig("shoal-ns"), "get", "pods", "-n",
                             "team-c", check=False)
        assert denied.returncode != 0 and "forbidden" in denied.stderr.lower(), denied.stderr
        run_operator_against(env, "shoal-ns", "team-b", unwatched="team-c")
    finally:
        env.helm("uninstall", "shoal", "--namespace", "shoal-ns")
