"""Where kv-aware routing finds each group's KV events (kv_subscriber.py): its host with the
configured ports, or endpoints given per group label."""

from __future__ import annotations

import pytest
from shoal.router.discovery import Group
from shoal.router.kv_subscriber import Endpoints, endpoints_from_ports, parse_endpoint


def test_a_groups_host_with_the_ports():
    of = endpoints_from_ports(5557, 5558)
    assert of(Group(1, "http://10.0.0.7:8000")) == Endpoints("tcp://10.0.0.7:5557",
                                                             "tcp://10.0.0.7:5558")
    assert of(Group(0, "http://[fd00::1]:8000")).events == "tcp://[fd00::1]:5557"
    assert endpoints_from_ports(5557, None)(Group(0, "http://a:1")).replay is None


def test_endpoints_given_per_label_win():
    given = dict([parse_endpoint("0=tcp://127.0.0.1:6000,tcp://127.0.0.1:6001"),
                  parse_endpoint("ns/llm/1=tcp://127.0.0.1:6002")])
    of = endpoints_from_ports(5557, 5558, given)
    assert of(Group(0, "http://127.0.0.1:8000")) == Endpoints("tcp://127.0.0.1:6000",
                                                              "tcp://127.0.0.1:6001")
    assert of(Group(1, "http://x:8000", "ns/llm")) == Endpoints("tcp://127.0.0.1:6002", None)
    assert of(Group(2, "http://x:8000")).events == "tcp://x:5557"


@pytest.mark.parametrize("spec", ["tcp://a:1", "=tcp://a:1", "0=", "0=a:1", "0=tcp://a:1,b:2"])
def test_bad_endpoint_specs_are_refused(spec):
    with pytest.raises(ValueError, match="--kv-endpoint"):
        parse_endpoint(spec)


async def test_discovery_drives_the_subscriptions_and_a_removed_group_leaves_the_index():
    from shoal.router.kv_index import KvIndex
    from shoal.router.kv_subscriber import KvSubscriber
    from shoal.router.kv_wire import BlockStored, KVEventBatch

    index = KvIndex()
    sub = KvSubscriber(index, endpoints_from_ports(5557, None))
    try:
        sub.set_groups([Group(0, "http://127.0.0.1:1"), Group(1, "http://127.0.0.2:1")])
        assert sorted(sub._tasks) == [("", 0), ("", 1)]
        index.apply(("", 1), 0, KVEventBatch(1.0, [BlockStored(
            block_hashes=[1], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=4,
            lora_id=None, medium="GPU", lora_name=None)]), 1.0)
        assert index.longest_prefix([1, 2, 3, 4]) == {("", 1): 4}
        sub.set_groups([Group(0, "http://127.0.0.1:1")])  # group 1 is gone
        assert sorted(sub._tasks) == [("", 0)] and index.longest_prefix([1, 2, 3, 4]) == {}
        sub.set_groups([Group(0, "http://127.0.0.3:1")])  # moved: a new epoch
        assert sub._tasks[("", 0)][0].events == "tcp://127.0.0.3:5557"
    finally:
        for _, task in sub._tasks.values():
            task.cancel()
        sub.ctx.destroy(linger=0)


def test_a_router_or_gateway_refuses_kv_aware_without_its_parts(tmp_path):
    from shoal.router.app import Router
    from shoal.router.gateway import Gateway

    with pytest.raises(ValueError, match="kv-aware"):
        Router(str(tmp_path / "engines.json"), served_model_names=None, default_model=None,
               api_keys=[], cooldown=1, poll_interval=1, probe_interval=1, routing="kv-aware")
    with pytest.raises(ValueError, match="kv-aware"):
        Gateway(namespaces=[], discovery_dir=str(tmp_path), kube=None, api_keys=[],
                routing="kv-aware")
