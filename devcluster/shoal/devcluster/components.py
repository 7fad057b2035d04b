"""Each component's command line and configuration, built from a small config: pure functions.

Why pure: the flags are where this small Kubernetes distribution makes its choices (what the
operator's tests need from the API server, what a node on a shared 2-core machine may do);
tests/devcluster checks them table by table without starting anything. The lifecycle
(control_plane.py, cluster.py) only picks ports, writes files and starts what these return.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shoal.devcluster.layout import CLUSTER_DOMAIN, HOST_IP, POD_CIDR, SERVICE_CIDR, NodeLayout

DEFAULT_CONTROLLERS = ("garbagecollector", "deployment", "replicaset", "statefulset", "namespace")
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
CNI_BIN = "/usr/lib/cni"


@dataclass(frozen=True)
class ControlPlaneConfig:
    """One control plane: its state directory, binaries, address, ports and policy.

    The suite's control plane (the defaults) authorizes everything and has no ServiceAccount
    admission (no token controller runs, and pods run nowhere); the cluster with nodes enforces
    RBAC, issues ServiceAccount tokens and runs every controller.
    """

    root: Path
    bin_dir: Path
    etcd: str = "etcd"
    address: str = "127.0.0.1"
    etcd_port: int = 2379
    peer_port: int = 2380
    server_port: int = 6443
    controller_manager_port: int = 10257
    scheduler_port: int = 10259
    controllers: tuple[str, ...] = DEFAULT_CONTROLLERS
    authorization_mode: str = "AlwaysAllow"
    service_accounts: bool = False

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def tokens_file(self) -> Path:
        return self.root / "tokens.csv"

    @property
    def components_kubeconfig(self) -> Path:
        """The controller manager's and the scheduler's kubeconfig."""
        return self.root / "kube-controller-manager.kubeconfig"

    @property
    def etcd_url(self) -> str:
        return f"http://127.0.0.1:{self.etcd_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def server(self) -> str:
        return f"https://{self.address}:{self.server_port}"


def etcd_args(c: ControlPlaneConfig) -> list[str]:
    return [
        c.etcd,
        "--name", "shoal-test",
        "--data-dir", str(c.root / "etcd"),
        "--listen-client-urls", c.etcd_url,
        "--advertise-client-urls", c.etcd_url,
        "--listen-peer-urls", c.peer_url,
        "--initial-advertise-peer-urls", c.peer_url,
        "--initial-cluster", f"shoal-test={c.peer_url}",
        "--logger", "zap",
        "--log-level", "warn",
        "--quota-backend-bytes", str(2 * 1024**3),
    ]


def apiserver_args(c: ControlPlaneConfig) -> list[str]:
    pki = c.pki
    without_service_accounts = [
        # No token controller runs, so ServiceAccount admission would reject every pod
        # ("no API token found"); pods run nowhere anyway.
        "--disable-admission-plugins", "ServiceAccount",
        "--endpoint-reconciler-type", "none",
    ]
    return [
        str(c.bin_dir / "kube-apiserver"),
        "--etcd-servers", c.etcd_url,
        "--bind-address", c.address,
        "--advertise-address", c.address,
        "--secure-port", str(c.server_port),
        "--tls-cert-file", str(pki / "apiserver.crt"),
        "--tls-private-key-file", str(pki / "apiserver.key"),
        "--client-ca-file", str(pki / "ca.crt"),
        # Front-proxy CA: published in kube-system/extension-apiserver-authentication, which the
        # controller manager's delegated authn otherwise complains about.
        "--requestheader-client-ca-file", str(pki / "ca.crt"),
        "--requestheader-allowed-names", "front-proxy-client",
        "--requestheader-username-headers", "X-Remote-User",
        "--requestheader-group-headers", "X-Remote-Group",
        "--requestheader-extra-headers-prefix", "X-Remote-Extra-",
        "--token-auth-file", str(c.tokens_file),
        "--authorization-mode", c.authorization_mode,
        "--service-account-key-file", str(pki / "sa.pub"),
        "--service-account-signing-key-file", str(pki / "sa.key"),
        "--service-account-issuer", SERVICE_ACCOUNT_ISSUER,
        "--service-cluster-ip-range", SERVICE_CIDR,
        "--allow-privileged=true",
        # Nodes are reached by their InternalIP: their names resolve nowhere.
        "--kubelet-preferred-address-types", "InternalIP,ExternalIP,Hostname",
        *([] if c.service_accounts else without_service_accounts),
        "--v", "1",
    ]


def _delegated(c: ControlPlaneConfig, binary: str, port: int, *own: str) -> list[str]:
    """What the controller manager and the scheduler share: one kubeconfig for everything,
    serving /healthz on loopback only, no insecure port; `own` goes before the serving flags."""
    kubeconfig = str(c.components_kubeconfig)
    return [
        str(c.bin_dir / binary),
        "--kubeconfig", kubeconfig,
        "--authentication-kubeconfig", kubeconfig,
        "--authorization-kubeconfig", kubeconfig,
        *own,
        "--bind-address", "127.0.0.1",
        "--secure-port", str(port),
        "--port", "0",
    ]


def controller_manager_args(c: ControlPlaneConfig) -> list[str]:
    return [
        *_delegated(c, "kube-controller-manager", c.controller_manager_port,
                    "--controllers", ",".join(c.controllers)),
        "--cert-dir", str(c.root / "kcm-certs"),
        "--leader-elect=false",
        "--use-service-account-credentials=false",
        "--service-account-private-key-file", str(c.pki / "sa.key"),
        "--root-ca-file", str(c.pki / "ca.crt"),
        "--concurrent-statefulset-syncs", "10",
        "--concurrent-gc-syncs", "20",
        "--v", "1",
    ]


def scheduler_args(c: ControlPlaneConfig) -> list[str]:
    return [*_delegated(c, "kube-scheduler", c.scheduler_port), "--leader-elect=false", "--v", "1"]


# -- nodes ---------------------------------------------------------------------------------------
def nsenter_net(n: NodeLayout) -> list[str]:
    """The node's network namespace. `nsenter`, not `ip netns exec`: that remounts /sys and
    hides the cgroup mounts from the kubelet."""
    return ["nsenter", f"--net={n.netns}"]


def nsenter_node(n: NodeLayout) -> list[str]:
    """The node's network and mount namespaces (for containerd, the kubelet and ctr)."""
    return [*nsenter_net(n), f"--mount={n.mntns}"]


def containerd_config(n: NodeLayout, pause_tag: str) -> str:
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


def containerd_args(n: NodeLayout, config: Path) -> list[str]:
    return [*nsenter_node(n), "containerd", "--config", str(config)]


def cni_config(n: NodeLayout) -> dict:
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
                    "ranges": [[{"subnet": n.pod_cidr}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(n.var / "cni-ipam"),
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def kubelet_args(n: NodeLayout, kubelet: Path, kubeconfig: Path, pause_tag: str) -> list[str]:
    return [
        *nsenter_node(n), str(kubelet),
        "--kubeconfig", str(kubeconfig),
        "--hostname-override", n.name,
        "--node-ip", n.ip,
        "--container-runtime=remote",
        f"--container-runtime-endpoint=unix://{n.sock}",
        "--runtime-request-timeout=10m",
        "--cgroup-driver=cgroupfs",
        # Two kubelets must not share /kubepods: each has a cgroup root of its own.
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


def kube_proxy_args(n: NodeLayout, kube_proxy: Path, kubeconfig: Path) -> list[str]:
    return [
        *nsenter_net(n), str(kube_proxy),
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


def dnsmasq_args(hosts_dir: Path, pid_file: Path) -> list[str]:
    """Cluster DNS: answers `cluster.local` from a hosts directory (dns.py keeps it in sync),
    TTL 0, no upstream (names outside the cluster do not resolve)."""
    return [
        "dnsmasq", "--keep-in-foreground", "--no-daemon", "--log-facility=-",
        f"--listen-address={HOST_IP}", "--bind-interfaces", "--except-interface=lo",
        "--port=53", "--no-resolv", "--no-hosts", "--no-poll",
        f"--hostsdir={hosts_dir}", f"--local=/{CLUSTER_DOMAIN}/", "--local-ttl=0",
        f"--pid-file={pid_file}", "--cache-size=0", "--user=root",
    ]
