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
