"""Cluster DNS without CoreDNS (not packaged): dnsmasq on the host end of the nodes' bridge
(components.dnsmasq_args), answering `cluster.local` from a hosts directory that a watcher keeps
in sync with the API.

Names written (A records):
- every Service with a ClusterIP: `SVC.NS.svc.cluster.local`;
- every pod with `hostname` and `subdomain` (the stable per-rank names a headless Service
  gives, published even before the pod is ready, as `publishNotReadyAddresses` does):
  `HOSTNAME.SUBDOMAIN.NS.svc.cluster.local`.

dnsmasq re-reads the directory on change (inotify), answers with TTL 0, and has no upstream:
names outside the cluster do not resolve, nothing leaves the machine.
"""

from __future__ import annotations

import os
import random
import socket
import struct
import threading
from pathlib import Path

from shoal.devcluster import api
from shoal.devcluster.layout import CLUSTER_DOMAIN, HOST_IP
from shoal.devcluster.procs import log


def records(services: list[dict], pods: list[dict]) -> list[tuple[str, str]]:
    """(address, name) for every Service with a ClusterIP and every pod with a stable name."""
    out = []
    for svc in services:
        ip = svc.get("spec", {}).get("clusterIP")
        meta = svc["metadata"]
        if ip and ip != "None":
            out.append((ip, f"{meta['name']}.{meta['namespace']}.svc.{CLUSTER_DOMAIN}"))
    for pod in pods:
        spec, meta = pod.get("spec", {}), pod["metadata"]
        ip = pod.get("status", {}).get("podIP")
        if ip and spec.get("hostname") and spec.get("subdomain") and not meta.get(
                "deletionTimestamp"):
            out.append((ip, f"{spec['hostname']}.{spec['subdomain']}.{meta['namespace']}"
                            f".svc.{CLUSTER_DOMAIN}"))
    return sorted(out)


class DnsWatcher:
    """Polls Services and pods every `interval` seconds and rewrites the hosts file when the
    records change (a list every half second costs the API server little at this size)."""

    def __init__(self, server: str, token: str, ca_file: Path, hosts_dir: Path,
                 interval: float = 0.5) -> None:
        self.server, self.token, self.ca_file, self.interval = server, token, ca_file, interval
        self.hosts_file = hosts_dir / "cluster"
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="dns-watcher", daemon=True)
        self.last: list | None = None
        self.error: str | None = None

    def _items(self, path: str) -> list[dict]:
        return api.get_json(self.server, path, self.token, self.ca_file)["items"]

    def sync(self) -> None:
        recs = records(self._items("/api/v1/services"), self._items("/api/v1/pods"))
        if recs != self.last:
            tmp = self.hosts_file.with_suffix(".tmp")
            tmp.write_text("".join(f"{ip} {name}\n" for ip, name in recs))
            os.replace(tmp, self.hosts_file)
            self.last = recs

    def _loop(self) -> None:
        while not self.stop.is_set():
            try:
                self.sync()
                if self.error:
                    log("dns watcher: API reachable again")
                self.error = None
            except Exception as exc:  # noqa: BLE001 - keep serving the last records
                if str(exc) != self.error:
                    log(f"dns watcher: {exc}")
                self.error = str(exc)
            self.stop.wait(self.interval)

    def start(self) -> DnsWatcher:
        self.hosts_file.parent.mkdir(parents=True, exist_ok=True)
        self.hosts_file.touch()
        self.thread.start()
        return self

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)


def query(name: str, qid: int) -> bytes:
    """A DNS question for `name` (A, IN, recursion desired)."""
    q = struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0)
    q += b"".join(bytes([len(p)]) + p.encode() for p in name.rstrip(".").split(".")) + b"\0"
    return q + struct.pack(">HH", 1, 1)


def resolves(name: str, timeout: float = 2.0) -> str | None:
    """Ask the cluster DNS for `name` (A); the address or None. A minimal stub resolver: the
    host's resolver does not know the cluster's server."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(timeout)
        s.sendto(query(name, random.randrange(65536)), (HOST_IP, 53))
        try:
            data = s.recv(512)
        except OSError:
            return None
    if len(data) < 12 or struct.unpack(">H", data[6:8])[0] == 0:
        return None
    return ".".join(str(b) for b in data[-4:])
