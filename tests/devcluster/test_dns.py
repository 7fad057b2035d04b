"""The cluster DNS's records from Services and pods (shoal.devcluster.dns), and its queries."""

from __future__ import annotations

import struct

import pytest
from shoal.devcluster import dns


def svc(name, ns, ip):
    return {"metadata": {"name": name, "namespace": ns}, "spec": {"clusterIP": ip}}


def pod(ns, ip, hostname=None, subdomain=None, deleting=False):
    meta = {"name": "p", "namespace": ns, **({"deletionTimestamp": "x"} if deleting else {})}
    spec = {k: v for k, v in (("hostname", hostname), ("subdomain", subdomain)) if v}
    return {"metadata": meta, "spec": spec, "status": {"podIP": ip} if ip else {}}


@pytest.mark.parametrize("services, pods, want", [
    ([svc("web", "default", "10.96.0.10")], [],
     [("10.96.0.10", "web.default.svc.cluster.local")]),
    ([svc("headless", "default", "None"), svc("pending", "default", None)], [], []),
    ([], [pod("ns1", "10.214.1.5", "e-g0-r1", "e-ranks")],
     [("10.214.1.5", "e-g0-r1.e-ranks.ns1.svc.cluster.local")]),
    ([], [pod("ns1", "10.214.1.5", "h")], []),  # no subdomain: no stable name
    ([], [pod("ns1", None, "h", "s")], []),  # no address yet
    ([], [pod("ns1", "10.214.1.5", "h", "s", deleting=True)], []),
    ([svc("b", "x", "10.96.0.2"), svc("a", "x", "10.96.0.1")], [],
     [("10.96.0.1", "a.x.svc.cluster.local"), ("10.96.0.2", "b.x.svc.cluster.local")]),
])
def test_records(services, pods, want):
    assert dns.records(services, pods) == want


@pytest.mark.parametrize("name, labels", [
    ("web.default.svc.cluster.local", [b"web", b"default", b"svc", b"cluster", b"local"]),
    ("a.b.", [b"a", b"b"]),
])
def test_query_encodes_one_a_question(name, labels):
    q = dns.query(name, 0x1234)
    assert struct.unpack(">HHHHHH", q[:12]) == (0x1234, 0x0100, 1, 0, 0, 0)
    body = b"".join(bytes([len(p)]) + p for p in labels) + b"\0"
    assert q[12:] == body + struct.pack(">HH", 1, 1)
