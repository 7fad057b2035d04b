"""The nodes' network: one bridge on the host, one network namespace per node.

    host: shoalbr0 10.213.0.1/24  (API server, DNS; routes to the pod and Service ranges)
      |- veth -> netns shoal-node1: eth0 10.213.0.11, pods 10.214.1.0/24 on cni0
      '- veth -> netns shoal-node2: eth0 10.213.0.12, pods 10.214.2.0/24 on cni0

Why a bridge: node-to-node (cross-node pod) traffic is switched by the bridge, so the host never
routes (its ip_forward stays as it is); forwarding is enabled inside the node namespaces only.
The host reaches pods through routes via each node, and Service IPs through node 1, whose
kube-proxy DNATs them (masquerading traffic from outside the pod range, so replies come back
through it). While node 1 is frozen (shoal.devcluster.freeze) they go through another node:
the host stands for a client of the cluster, which a real lost machine does not cut off.
"""

from __future__ import annotations

from shoal.devcluster.layout import (
    BRIDGE,
    HOST_IP,
    NODE_NAMES,
    SERVICE_CIDR,
    NodeLayout,
    nodes,
)
from shoal.devcluster.procs import log, run


def _ip(*args: str, check: bool = True):
    return run(["ip", *args], check=check)


def _in_ns(ns: str, *argv: str, check: bool = True):
    return run(["ip", "netns", "exec", ns, *argv], check=check)


def host_veth(index: int) -> str:
    return f"shoalv{index + 1}"


def setup() -> None:
    """Create the bridge, the node namespaces, their veths and routes (a leftover from a killed
    run is removed first by teardown)."""
    _ip("link", "add", BRIDGE, "type", "bridge")
    _ip("addr", "add", f"{HOST_IP}/24", "dev", BRIDGE)
    _ip("link", "set", BRIDGE, "up")
    for n in nodes():
        ns, veth = n.name, host_veth(n.index)
        _ip("netns", "add", ns)
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", veth, "master", BRIDGE, "up")
        _in_ns(ns, "ip", "addr", "add", f"{n.ip}/24", "dev", "eth0")
        _in_ns(ns, "ip", "link", "set", "eth0", "up")
        _in_ns(ns, "ip", "link", "set", "lo", "up")
        # Only these addresses leave the node: the host (API server, DNS) is on-link; other
        # nodes' pod ranges go to those nodes. No default route, so nothing else is reachable.
        for other in nodes():
            if other != n:
                _in_ns(ns, "ip", "route", "add", other.pod_cidr, "via", other.ip)
        # A route to the host is needed for kube-proxy's Service rules to apply to traffic
        # whose destination is a ClusterIP (route lookup happens after DNAT).
        _in_ns(ns, "ip", "route", "add", SERVICE_CIDR, "via", HOST_IP)
        for key, val in (("net.ipv4.ip_forward", "1"),
                         ("net.ipv4.conf.all.route_localnet", "1")):
            _in_ns(ns, "sysctl", "-qw", f"{key}={val}")
        _ip("route", "add", n.pod_cidr, "via", n.ip, "dev", BRIDGE)
    _ip("route", "add", SERVICE_CIDR, "via", nodes()[0].ip, "dev", BRIDGE)
    log(f"network: bridge {BRIDGE} {HOST_IP}/24, nodes "
        + ", ".join(f"{n.name} {n.ip} pods {n.pod_cidr}" for n in nodes()))


def route_services(via: NodeLayout) -> None:
    """Send the host's Service traffic through `via`'s kube-proxy."""
    _ip("route", "replace", SERVICE_CIDR, "via", via.ip, "dev", BRIDGE)
    log(f"network: Service IPs ({SERVICE_CIDR}) from the host now go through {via.name}")


def teardown() -> None:
    """Remove routes, veths, namespaces and the bridge; missing pieces are fine."""
    _ip("route", "del", SERVICE_CIDR, "dev", BRIDGE, check=False)
    for n in nodes():
        _ip("route", "del", n.pod_cidr, "dev", BRIDGE, check=False)
        _ip("link", "del", host_veth(n.index), check=False)
        if n.netns.exists():
            _ip("netns", "del", n.name, check=False)
    _ip("link", "del", BRIDGE, check=False)


def leftovers() -> list[str]:
    """What of the network is still on the host (for the teardown check)."""
    found = []
    links = run(["ip", "-o", "link", "show"], check=False).stdout.decode()
    for name in (BRIDGE, *(host_veth(i) for i in range(len(NODE_NAMES)))):
        if f": {name}:" in links or f": {name}@" in links:
            found.append(f"link {name}")
    found += [f"netns {n.name}" for n in nodes() if n.netns.exists()]
    routes = run(["ip", "route", "show"], check=False).stdout.decode()
    found += [f"route {line}" for line in routes.splitlines() if BRIDGE in line]
    return found
