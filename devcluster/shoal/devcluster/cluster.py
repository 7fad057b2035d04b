"""The local cluster with real nodes: the control plane (control_plane.py, with RBAC, a
scheduler and every controller), two nodes (containerd + runc + kubelet + kube-proxy, each in its
own network namespace, CNI bridge networking) and cluster DNS (dnsmasq). Runs as root.

`start` builds what is missing (`prepare`), then runs a detached supervisor
(`python -m shoal.devcluster supervise`, log `$SHOAL_CACHE/cluster/logs/supervisor.log`) that owns
every process; `$SHOAL_CACHE/cluster/cluster.json` says where things are while it runs.
Component logs: `$SHOAL_CACHE/cluster/logs/`. See docs/cluster.md.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from shoal.devcluster import api, build, clean, images, net, node
from shoal.devcluster.components import containerd_args, dnsmasq_args, kube_proxy_args, kubelet_args
from shoal.devcluster.control_plane import ControlPlane, stop_dir
from shoal.devcluster.dns import DnsWatcher
from shoal.devcluster.layout import (
    API_PORT,
    BUILD_SCRIPT,
    HOST_IP,
    MODEL_HOST_DIR,
    NODE_NAMES,
    RUN_DIR,
    NodeLayout,
    bin_dir,
    images_file,
    logs_dir,
    node_store,
    nodes,
    state_dir,
    state_file,
)
from shoal.devcluster.pki import write_kubeconfig
from shoal.devcluster.procs import DevClusterError, Process, log, pid_runs, wait_until

SUPERVISOR = ("-m", "shoal.devcluster", "supervise")
# `apiserver-outage`: the request the supervisor's loop picks up, and its answer
OUTAGE_REQUEST = RUN_DIR / "apiserver-outage.request"
OUTAGE_RESULT = RUN_DIR / "apiserver-outage.result"
# Left free after the images are in: the kubelets' eviction floor (1 GiB, components) plus
# room for pod logs, emptyDirs and the engines' compile caches.
DISK_MARGIN = 3 << 30


class Cluster:
    """What the supervisor runs. `up()` brings everything up; `down()` tears it all down."""

    def __init__(self) -> None:
        self.root = state_dir()
        self.cp: ControlPlane | None = None
        self.procs: list[Process] = []
        self.dns: DnsWatcher | None = None
        self.nodes = nodes()

    def up(self) -> dict:
        t0 = time.monotonic()
        clean.clean_all(quiet=True)
        logs_dir().mkdir(parents=True, exist_ok=True)
        for d in (RUN_DIR, MODEL_HOST_DIR):
            d.mkdir(parents=True, exist_ok=True)
        net.setup()
        node_kubeconfig = self._start_control_plane()
        self._start_dns()
        archives = self._archives()
        self._start_containerds()
        self._load_images(archives)
        for n in self.nodes:
            self._spawn(f"{n.name}-kubelet", kubelet_args(
                n, bin_dir() / "kubelet", node_kubeconfig, images.PAUSE_TAG))
            self._spawn(f"{n.name}-kube-proxy", kube_proxy_args(
                n, bin_dir() / "kube-proxy", node_kubeconfig))
        log("nodes: kubelet and kube-proxy started; waiting for both nodes Ready")
        wait_until(self._nodes_ready, "both nodes Ready", 180, self.check_alive)
        return self._write_state(time.monotonic() - t0)

    def _spawn(self, name: str, argv: list[str]) -> None:
        self.procs.append(Process(name, argv, logs_dir() / f"{name}.log").start())

    def _start_control_plane(self) -> Path:
        """A fresh control plane on the bridge; returns the kubeconfig the nodes use."""
        log("control plane: etcd, kube-apiserver (RBAC), kube-controller-manager, kube-scheduler")
        for stale in ("etcd", "state.json"):  # a fresh cluster each start
            p = self.root / stale
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
        self.cp = ControlPlane(
            self.root, controllers=("*",), address=HOST_IP, server_port=API_PORT,
            authorization_mode="RBAC", service_accounts=True, scheduler=True)
        self.cp.start(timeout=180)
        log(f"control plane up in {self.cp.started_s:.1f}s: {self.cp.server}")
        # Components authenticate with the admin token (system:masters); RBAC applies to every
        # ServiceAccount, i.e. to the operator and to everything running in pods.
        node_kubeconfig = RUN_DIR / "node.kubeconfig"
        write_kubeconfig(node_kubeconfig, self.cp.server, self.cp.ca_file, self.cp.token)
        return node_kubeconfig

    def _start_dns(self) -> None:
        hosts_dir = RUN_DIR / "dns"
        self.dns = DnsWatcher(self.cp.server, self.cp.token, self.cp.ca_file, hosts_dir).start()
        self._spawn("dnsmasq", dnsmasq_args(hosts_dir, RUN_DIR / "dnsmasq.pid"))

    def _start_containerds(self) -> None:
        for n in self.nodes:
            cfg = node.prepare(n, images.PAUSE_TAG)
            self._spawn(f"{n.name}-containerd", containerd_args(n, cfg))
        for n in self.nodes:
            wait_until(lambda n=n: node.containerd_ok(n), f"{n.name} containerd", 60,
                       self.check_alive)
        for n in self.nodes:
            purged = node.purge_containers(n)
            if purged:
                log(f"{n.name}: removed {purged} container(s) left by an earlier run")

    def _archives(self) -> dict[str, Path]:
        """The archives `prepare` built (named in images.json: the sources may have changed
        since, e.g. under an editor, and must not send the supervisor looking for another)."""
        built = json.loads(images_file().read_text())
        return {"pause": images.build_pause(bin_dir() / "pause"),
                **{k: Path(v) for k, v in built.items()}}

    def _load_images(self, archives: dict[str, Path]) -> None:
        for archive in archives.values():
            if not archive.is_file():
                raise DevClusterError(f"image archive {archive} missing (build it first)")
        todo = {}
        for n in self.nodes:
            held = images.node_images(n.sock)
            todo[n.name] = [w for w, a in archives.items()
                            if images.needs_import(held, n.store, a, w)]
        check_disk(sum(archives[w].stat().st_size for ws in todo.values() for w in ws))
        errors: list[str] = []

        def load(n: NodeLayout) -> None:
            try:
                for what in todo[n.name]:
                    images.import_into_node(n.sock, n.store, archives[what], what)
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(f"{n.name}: {exc}")

        threads = [threading.Thread(target=load, args=(n,)) for n in self.nodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise DevClusterError("loading images failed: " + "; ".join(errors))

    def _nodes_ready(self) -> bool:
        items = api.get_json(self.cp.server, "/api/v1/nodes", self.cp.token,
                             self.cp.ca_file)["items"]
        ready = {i["metadata"]["name"] for i in items for c in i["status"].get("conditions", [])
                 if c["type"] == "Ready" and c["status"] == "True"}
        return ready >= set(NODE_NAMES)

    def _write_state(self, up_s: float) -> dict:
        state = {
            "server": self.cp.server, "kubeconfig": str(self.cp.kubeconfig),
            "token": self.cp.token, "ca_file": str(self.cp.ca_file),
            "supervisor": os.getpid(), "nodes": list(NODE_NAMES), "dns": HOST_IP,
            "model_dir": str(MODEL_HOST_DIR), "logs": str(logs_dir()), "up_s": round(up_s, 1),
        }
        tmp = state_file().with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        os.replace(tmp, state_file())
        log(f"cluster up in {state['up_s']}s: {self.cp.server}, nodes {', '.join(NODE_NAMES)}")
        return state

    def check_alive(self) -> None:
        for p in self.procs:
            p.check()
        if self.cp is not None:
            self.cp.check_alive()

    def serve_outage(self) -> None:
        """An outage asked for by `apiserver-outage` (a request file, since the supervisor owns
        the control plane's processes): done here, then answered in the result file."""
        if not OUTAGE_REQUEST.exists():
            return
        seconds = float(json.loads(OUTAGE_REQUEST.read_text())["seconds"])
        OUTAGE_REQUEST.unlink()
        log(f"outage: kube-apiserver down for {seconds:.0f}s")
        result = self.cp.outage("kube-apiserver", seconds)
        log(f"outage: kube-apiserver back: {result}")
        OUTAGE_RESULT.write_text(json.dumps(result))

    def down(self) -> None:
        if self.dns is not None:
            self.dns.close()
        for p in reversed(self.procs):  # kube-proxy/kubelet first, containerd, dnsmasq last
            p.stop()
        if self.cp is not None:
            self.cp.stop()
        clean.clean_all()
        state_file().unlink(missing_ok=True)


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
        raise DevClusterError(
            f"only {free / 2**30:.1f} GiB free on the disk holding {store}; the nodes need about "
            f"{need / 2**30:.1f} GiB (images to import, unpacked, plus {DISK_MARGIN >> 30} GiB). "
            "Free some space: old image builds are pruned by `python -m shoal.devcluster "
            "prepare`, `du -sh ~/.cache/shoal/*` shows the rest")


# -- what the CLI runs -----------------------------------------------------------------------
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
            cluster.serve_outage()
            time.sleep(1)
    except KeyboardInterrupt:
        log("stopping")
        return 0
    except Exception as exc:  # noqa: BLE001 - logged for the starter, which shows the log
        log(f"FAILED: {exc}")
        return 1
    finally:
        cluster.down()


def prepare() -> dict[str, Path]:
    """Binaries (build.sh all) and image archives, with progress; a no-op when cached.

    On a cold cache the Kubernetes build (CPU-bound Go compiles) and the image builds (mostly
    downloads, debootstrap and unpacking) run side by side: the packages both need come first."""
    build.run_build("packages")
    log(f"binaries: {BUILD_SCRIPT} all (cold: 15-20 minutes on 2 cores; cached afterwards), "
        "images alongside")
    binaries = build.start_build("all")
    try:
        built = images.build_all()
    except BaseException:
        binaries.terminate()
        binaries.wait()
        raise
    if binaries.wait() != 0:
        raise DevClusterError(f"{BUILD_SCRIPT} all failed (exit {binaries.returncode})")
    images.prune_store()
    images_file().parent.mkdir(parents=True, exist_ok=True)
    images_file().write_text(json.dumps({k: str(v) for k, v in built.items()}, indent=2) + "\n")
    return built


def running_state() -> dict | None:
    """The running cluster's cluster.json, or None."""
    f = state_file()
    if not f.exists():
        return None
    state = json.loads(f.read_text())
    if not pid_runs(state["supervisor"], " ".join(SUPERVISOR)):
        return None
    return state


def start(timeout: float = 900.0) -> dict:
    """Prepare, start a detached supervisor and follow its log until the cluster is up (or
    reuse a running one); returns cluster.json."""
    state = running_state()
    if state is not None:
        log(f"already running (supervisor pid {state['supervisor']}); reusing it")
        return state
    prepare()
    state_file().unlink(missing_ok=True)
    logs_dir().mkdir(parents=True, exist_ok=True)
    sup_log = logs_dir() / "supervisor.log"
    sup_log.write_text("")
    with open(sup_log, "ab") as out:
        sup = subprocess.Popen([sys.executable, *SUPERVISOR], stdin=subprocess.DEVNULL,
                               stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    log(f"supervisor pid {sup.pid}, log {sup_log}")
    shown = 0
    deadline = time.monotonic() + timeout
    while True:
        lines = sup_log.read_text(errors="replace").splitlines()
        for line in lines[shown:]:
            print(f"  {line}", file=sys.stderr, flush=True)
        shown = len(lines)
        if state_file().exists():
            return json.loads(state_file().read_text())
        if sup.poll() is not None:
            raise DevClusterError(f"the cluster did not come up (supervisor exit "
                                  f"{sup.returncode}); logs in {logs_dir()}")
        if time.monotonic() > deadline:
            sup.terminate()
            raise DevClusterError(f"the cluster was not up after {timeout:.0f}s; logs in "
                                  f"{logs_dir()}")
        time.sleep(0.5)


def apiserver_outage(seconds: float) -> dict:
    """Stop the running cluster's API server for `seconds` and start it again (its supervisor
    does it); returns when it answers again, with the timings."""
    if running_state() is None:
        raise DevClusterError("no cluster is running")
    OUTAGE_RESULT.unlink(missing_ok=True)
    OUTAGE_REQUEST.write_text(json.dumps({"seconds": seconds}))
    deadline = time.monotonic() + seconds + 180
    while not OUTAGE_RESULT.exists():
        if time.monotonic() > deadline or running_state() is None:
            raise DevClusterError(f"the API server outage did not end; see {logs_dir()}")
        time.sleep(0.5)
    return json.loads(OUTAGE_RESULT.read_text())


def _supervisor_pid() -> int | None:
    """The supervisor's pid from cluster.json, or found among the processes (one still
    starting has no state file)."""
    if state_file().exists():
        return json.loads(state_file().read_text())["supervisor"]
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and int(p.name) != os.getpid():
            try:
                argv = (p / "cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            if tuple(argv[1:4]) == SUPERVISOR:
                return int(p.name)
    return None


def stop() -> list[str]:
    """Stop the supervisor (it tears down), then clean whatever is left either way; returns
    what could not be removed."""
    sup = _supervisor_pid()
    needle = " ".join(SUPERVISOR)
    if sup is not None and pid_runs(sup, needle):
        log(f"stopping supervisor pid {sup}")
        os.kill(sup, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while pid_runs(sup, needle):
            if time.monotonic() > deadline:
                os.kill(sup, signal.SIGKILL)
                break
            time.sleep(0.2)
    stop_dir(state_dir())
    left = clean.clean_all()
    state_file().unlink(missing_ok=True)
    return left
