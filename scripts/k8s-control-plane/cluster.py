"""A local Kubernetes cluster with real nodes: the control plane (control_plane.py) plus
kube-scheduler, two nodes (containerd + runc + kubelet + kube-proxy, each in its own network
namespace, CNI bridge networking) and cluster DNS (dnsmasq). Runs as root; stdlib only.

    python3 cluster.py start   # build what is missing, start detached, load the images
    python3 cluster.py stop    # stop everything and remove it from the host
    python3 cluster.py status

`start` is what `make cluster` and the e2e tests call (make cluster then installs the chart and
an example: cluster_demo.py). A detached supervisor (`cluster.py supervise`, log
`$SHOAL_CACHE/cluster/logs/supervisor.log`) owns every process; `$SHOAL_CACHE/cluster/cluster.json`
says where things are while it runs. Component logs: `$SHOAL_CACHE/cluster/logs/`.
See docs/cluster.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import cluster_clean
import cluster_dns
import cluster_images
import cluster_net
import cluster_node
import control_plane
from cluster_common import (
    API_PORT,
    HOST_IP,
    MODEL_HOST_DIR,
    NODE_NAMES,
    RUN_DIR,
    ClusterError,
    log,
    node_store,
    run,
    state_dir,
    tail,
)

BUILD_SCRIPT = Path(__file__).resolve().parent / "build.sh"


def logs_dir() -> Path:
    return state_dir() / "logs"


class Proc:
    """A long-running component with its log; dies with the supervisor (PR_SET_PDEATHSIG)."""

    def __init__(self, name: str, argv: list[str]) -> None:
        self.name, self.argv = name, argv
        self.log = logs_dir() / f"{name}.log"
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=control_plane._die_with_parent)

    def check(self) -> None:
        if self.proc.poll() is not None:
            raise ClusterError(f"{self.name} exited with code {self.proc.returncode}; log "
                               f"{self.log}:\n{tail(self.log)}")

    def stop(self, grace: float = 5.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def wait(cond, what: str, timeout: float, procs: list[Proc] = (), interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while True:
        for p in procs:
            p.check()
        val = cond()
        if val:
            return val
        if time.monotonic() > deadline:
            raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


class Cluster:
    """What the supervisor runs. `up()` brings everything up; `down()` tears it all down."""

    def __init__(self) -> None:
        self.root = state_dir()
        self.cp: control_plane.ControlPlane | None = None
        self.procs: list[Proc] = []
        self.dns: cluster_dns.DnsWatcher | None = None
        self.nodes = [cluster_node.NodePaths(n, i) for i, n in enumerate(NODE_NAMES)]

    def kubectl_json(self, *args: str) -> dict:
        from urllib.request import Request, urlopen

        assert self.cp is not None
        req = Request(self.cp.server + args[0], headers={"Authorization": f"Bearer {self.cp.token}"})
        with urlopen(req, timeout=10, context=self.cp._ssl_context(True)) as r:
            return json.load(r)

    def up(self) -> dict:
        t0 = time.monotonic()
        cluster_clean.clean_all(quiet=True)
        logs_dir().mkdir(parents=True, exist_ok=True)
        for d in (RUN_DIR, MODEL_HOST_DIR):
            d.mkdir(parents=True, exist_ok=True)
        cluster_net.setup()

        log("control plane: etcd, kube-apiserver (RBAC), kube-controller-manager, kube-scheduler")
        for stale in ("etcd", "state.json"):  # a fresh cluster each start
            p = self.root / stale
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
        self.cp = control_plane.ControlPlane(
            self.root, controllers=("*",), address=HOST_IP, server_port=API_PORT,
            authorization_mode="RBAC", service_accounts=True, scheduler=True)
        self.cp.start(timeout=180)
        log(f"control plane up in {self.cp.started_s:.1f}s: {self.cp.server}")
        # Components authenticate with the admin token (system:masters); RBAC applies to every
        # ServiceAccount, i.e. to the operator and to everything running in pods.
        node_kubeconfig = RUN_DIR / "node.kubeconfig"
        control_plane.write_kubeconfig(node_kubeconfig, self.cp.server, self.cp.ca_file,
                                       self.cp.token)

        hosts_dir = RUN_DIR / "dns"
        self.dns = cluster_dns.DnsWatcher(self.cp.server, self.cp.token, self.cp.ca_file,
                                          hosts_dir).start()
        self.procs.append(Proc("dnsmasq", cluster_dns.dnsmasq_argv(hosts_dir,
                                                                    RUN_DIR / "dnsmasq.pid")))

        archives = self._archives()
        for n in self.nodes:
            cfg = cluster_node.prepare(n, cluster_images.PAUSE_TAG)
            self.procs.append(Proc(f"{n.name}-containerd", cluster_node.containerd_argv(n, cfg)))
        for n in self.nodes:
            wait(lambda n=n: n.sock.exists() and self._ctr_ok(n), f"{n.name} containerd", 60,
                 self.procs)
        for n in self.nodes:
            purged = cluster_node.purge_containers(n)
            if purged:
                log(f"{n.name}: removed {purged} container(s) left by an earlier run")
        self._load_images(archives)
        bins = control_plane.bin_dir()
        for n in self.nodes:
            self.procs.append(Proc(f"{n.name}-kubelet", cluster_node.kubelet_argv(
                n, bins / "kubelet", node_kubeconfig, cluster_images.PAUSE_TAG)))
            self.procs.append(Proc(f"{n.name}-kube-proxy", cluster_node.kube_proxy_argv(
                n, bins / "kube-proxy", node_kubeconfig)))
        log("nodes: kubelet and kube-proxy started; waiting for both nodes Ready")
        wait(self._nodes_ready, "both nodes Ready", 180, self.procs)
        state = {
            "server": self.cp.server, "kubeconfig": str(self.cp.kubeconfig),
            "token": self.cp.token, "ca_file": str(self.cp.ca_file),
            "supervisor": os.getpid(), "nodes": list(NODE_NAMES), "dns": HOST_IP,
            "model_dir": str(MODEL_HOST_DIR), "logs": str(logs_dir()),
            "up_s": round(time.monotonic() - t0, 1),
        }
        tmp = cluster_clean.state_file().with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        os.replace(tmp, cluster_clean.state_file())
        log(f"cluster up in {state['up_s']}s: {self.cp.server}, nodes {', '.join(NODE_NAMES)}")
        return state

    def _archives(self) -> dict[str, Path]:
        """The archives `prepare` built (named in images.json: the sources may have changed
        since, e.g. under an editor, and must not send the supervisor looking for another)."""
        built = json.loads(images_file().read_text())
        return {"pause": cluster_images.build_pause(control_plane.bin_dir() / "pause"),
                **{k: Path(v) for k, v in built.items()}}

    def _ctr_ok(self, n: cluster_node.NodePaths) -> bool:
        return run(["ctr", "-a", str(n.sock), "version"], check=False).returncode == 0

    def _load_images(self, archives: dict[str, Path]) -> None:
        for archive in archives.values():
            if not archive.is_file():
                raise ClusterError(f"image archive {archive} missing (build it first)")
        todo = {}
        for n in self.nodes:
            held = cluster_images.node_images(n.sock)
            todo[n.name] = [w for w, a in archives.items()
                            if cluster_images.needs_import(held, n.store, a, w)]
        check_disk(sum(archives[w].stat().st_size for ws in todo.values() for w in ws))
        errors: list[str] = []

        def load(n: cluster_node.NodePaths) -> None:
            try:
                for what in todo[n.name]:
                    cluster_images.import_into_node(n.sock, n.store, archives[what], what)
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(f"{n.name}: {exc}")

        threads = [threading.Thread(target=load, args=(n,)) for n in self.nodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise ClusterError("loading images failed: " + "; ".join(errors))

    def _nodes_ready(self) -> bool:
        self.cp.check_alive()
        items = self.kubectl_json("/api/v1/nodes")["items"]
        ready = {i["metadata"]["name"] for i in items for c in i["status"].get("conditions", [])
                 if c["type"] == "Ready" and c["status"] == "True"}
        return ready >= set(NODE_NAMES)

    def check_alive(self) -> None:
        for p in self.procs:
            p.check()
        if self.cp is not None:
            self.cp.check_alive()

    def down(self) -> None:
        if self.dns is not None:
            self.dns.close()
        for p in reversed(self.procs):  # kube-proxy/kubelet first, containerd, dnsmasq last
            p.stop()
        if self.cp is not None:
            self.cp.stop()
        cluster_clean.clean_all()
        cluster_clean.state_file().unlink(missing_ok=True)


# Left free after the images are in: the kubelets' eviction floor (1 GiB, cluster_node) plus
# room for pod logs, emptyDirs and the engines' compile caches.
DISK_MARGIN = 3 << 30


def check_disk(import_bytes: int) -> None:
    """Log the free space the nodes will live on, and refuse to start when importing the images
    (their content plus the unpacked snapshot: about twice the archive) would leave less than
    DISK_MARGIN: a node short of disk taints itself and deletes its images, and pods then wait
    unscheduled with nothing in the test output saying why."""
    store = node_store(NODE_NAMES[0]).parent
    store.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(store).free
    need = 2 * import_bytes + DISK_MARGIN
    log(f"disk: {free / 2**30:.1f} GiB free for the node stores ({store}); images to import: "
        f"{import_bytes / 2**30:.1f} GiB")
    if free < need:
        raise ClusterError(
            f"only {free / 2**30:.1f} GiB free on the disk holding {store}; the nodes need about "
            f"{need / 2**30:.1f} GiB (images to import, unpacked, plus {DISK_MARGIN >> 30} GiB). "
            "Free some space: old image builds are pruned by `cluster.py prepare`, "
            "`du -sh ~/.cache/shoal/*` shows the rest")


# -- entry points ------------------------------------------------------------------------------
def supervise() -> int:
    """Foreground: bring the cluster up, watch it, tear it down on SIGTERM/SIGINT."""
    def on_term(signum, frame):  # noqa: ARG001
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    cluster = Cluster()
    try:
        cluster.up()
        while True:
            cluster.check_alive()
            time.sleep(1)
    except KeyboardInterrupt:
        log("stopping")
        return 0
    except Exception as exc:  # noqa: BLE001 - logged for the starter, which shows the log
        log(f"FAILED: {exc}")
        return 1
    finally:
        cluster.down()


def ensure_prerequisites() -> None:
    """Binaries (build.sh all) and image archives, with progress; a no-op when cached.

    On a cold cache the Kubernetes build (CPU-bound Go compiles) and the image builds (mostly
    downloads, debootstrap and unpacking) run side by side: the packages both need come first."""
    proc = subprocess.run(["bash", str(BUILD_SCRIPT), "packages"], stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise ClusterError(f"{BUILD_SCRIPT} packages failed (exit {proc.returncode})")
    log(f"binaries: {BUILD_SCRIPT} all (cold: 15-20 minutes on 2 cores; cached afterwards), "
        "images alongside")
    binaries = subprocess.Popen(["bash", str(BUILD_SCRIPT), "all"], stdin=subprocess.DEVNULL)
    try:
        built = {"operator": cluster_images.build_target("operator", cluster_images.OPERATOR_TAG),
                 "engine": cluster_images.build_target("engine", cluster_images.ENGINE_TAG)}
    except BaseException:
        binaries.terminate()
        binaries.wait()
        raise
    if binaries.wait() != 0:
        raise ClusterError(f"{BUILD_SCRIPT} all failed (exit {binaries.returncode})")
    cluster_images.prune_store()
    images_file().parent.mkdir(parents=True, exist_ok=True)
    images_file().write_text(json.dumps({k: str(v) for k, v in built.items()}, indent=2) + "\n")


def images_file() -> Path:
    return state_dir() / "images.json"


def running_state() -> dict | None:
    f = cluster_clean.state_file()
    if not f.exists():
        return None
    state = json.loads(f.read_text())
    if not control_plane._pid_runs(state["supervisor"], "cluster.py"):
        return None
    return state


def start(timeout: float = 900.0) -> dict:
    state = running_state()
    if state is not None:
        log(f"already running (supervisor pid {state['supervisor']}); reusing it")
        return state
    ensure_prerequisites()
    cluster_clean.state_file().unlink(missing_ok=True)
    logs_dir().mkdir(parents=True, exist_ok=True)
    sup_log = logs_dir() / "supervisor.log"
    sup_log.write_text("")
    sup = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "supervise"],
                           stdin=subprocess.DEVNULL, stdout=open(sup_log, "ab"),
                           stderr=subprocess.STDOUT, start_new_session=True)
    log(f"supervisor pid {sup.pid}, log {sup_log}")
    shown = 0
    deadline = time.monotonic() + timeout
    while True:
        lines = sup_log.read_text(errors="replace").splitlines()
        for line in lines[shown:]:
            print(f"  {line}", file=sys.stderr, flush=True)
        shown = len(lines)
        if cluster_clean.state_file().exists():
            return json.loads(cluster_clean.state_file().read_text())
        if sup.poll() is not None:
            raise ClusterError(f"the cluster did not come up (supervisor exit {sup.returncode}); "
                               f"logs in {logs_dir()}")
        if time.monotonic() > deadline:
            sup.terminate()
            raise ClusterError(f"the cluster was not up after {timeout:.0f}s; logs in {logs_dir()}")
        time.sleep(0.5)


def stop() -> list[str]:
    """Stop the supervisor (it tears down), then clean whatever is left either way."""
    state = None
    f = cluster_clean.state_file()
    if f.exists():
        state = json.loads(f.read_text())
    else:
        for p in Path("/proc").iterdir():  # a supervisor still starting has no state file
            if p.name.isdigit() and int(p.name) != os.getpid():
                try:
                    cmd = (p / "cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                if len(cmd) > 2 and cmd[1].endswith(b"cluster.py") and cmd[2] == b"supervise":
                    state = {"supervisor": int(p.name)}
    if state and control_plane._pid_runs(state["supervisor"], "cluster.py"):
        log(f"stopping supervisor pid {state['supervisor']}")
        os.kill(state["supervisor"], signal.SIGTERM)
        deadline = time.monotonic() + 60
        while control_plane._pid_runs(state["supervisor"], "cluster.py"):
            if time.monotonic() > deadline:
                os.kill(state["supervisor"], signal.SIGKILL)
                break
            time.sleep(0.2)
    control_plane.stop_dir(state_dir())
    left = cluster_clean.clean_all()
    f.unlink(missing_ok=True)
    return left


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cmd", choices=("start", "stop", "status", "supervise", "prepare"))
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("cluster.py needs root (network namespaces, mounts, cgroups)", file=sys.stderr)
        return 2
    try:
        if args.cmd == "supervise":
            return supervise()
        if args.cmd == "prepare":
            ensure_prerequisites()
            return 0
        if args.cmd == "start":
            state = start()
            print(json.dumps(state, indent=2))
            return 0
        if args.cmd == "stop":
            left = stop()
            return 1 if left else 0
        state = running_state()
        print(json.dumps(state, indent=2) if state else "not running")
        return 0 if state else 1
    except ClusterError as exc:
        log(f"ERROR: {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
