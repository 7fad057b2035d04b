"""Addresses and directories of the dev cluster (shoal.devcluster.layout, net)."""

from __future__ import annotations

from pathlib import Path

import pytest
from shoal.devcluster import layout, net


@pytest.mark.parametrize("index, name, ip, pods, veth", [
    (0, "shoal-node1", "10.213.0.11", "10.214.1.0/24", "shoalv1"),
    (1, "shoal-node2", "10.213.0.12", "10.214.2.0/24", "shoalv2"),
])
def test_node_addresses(index, name, ip, pods, veth):
    n = layout.nodes()[index]
    assert (n.name, n.ip, n.pod_cidr, net.host_veth(n.index)) == (name, ip, pods, veth)


@pytest.mark.parametrize("attr, want", [
    ("netns", "/run/netns/shoal-node1"),
    ("run", "/run/shoal-cluster/shoal-node1"),
    ("var", "/var/lib/shoal-cluster/shoal-node1"),
    ("sock", "/run/shoal-cluster/shoal-node1/containerd.sock"),
    ("mntns", "/run/shoal-cluster/shoal-node1/ns/mnt"),
])
def test_node_directories(attr, want):
    assert getattr(layout.NodeLayout("shoal-node1", 0), attr) == Path(want)


@pytest.mark.parametrize("where, want", [
    (layout.k8s_cache, "k8s"),
    (layout.bin_dir, "k8s/bin"),
    (layout.state_dir, "cluster"),
    (layout.logs_dir, "cluster/logs"),
    (layout.state_file, "cluster/cluster.json"),
    (layout.images_file, "cluster/images.json"),
    (lambda: layout.node_store("shoal-node2"), "cluster-nodes/shoal-node2"),
])
def test_caches_follow_shoal_cache(monkeypatch, tmp_path, where, want):
    monkeypatch.setenv("SHOAL_CACHE", str(tmp_path))
    assert where() == tmp_path / want


def test_node_ranges_are_inside_the_cluster_ranges():
    for n in layout.nodes():
        assert n.pod_cidr.startswith("10.214.") and layout.POD_CIDR == "10.214.0.0/16"
        assert n.ip.startswith("10.213.0.") and layout.BRIDGE_CIDR == "10.213.0.0/24"


def test_build_script_ships_inside_the_package():
    assert layout.BUILD_SCRIPT == layout.PACKAGE_DIR / "build.sh"
    assert layout.BUILD_SCRIPT.is_file()
    assert (layout.REPO / "Dockerfile").is_file()
