"""The router's pure parts: the discovery file's validation and watcher, and the group picker's
rules (least outstanding, round-robin ties, cool-downs)."""

from __future__ import annotations

import json
import logging
import os

import pytest
from shoal.router.discovery import DiscoveryWatcher, Group, parse_discovery
from shoal.router.picker import GroupPicker

G0, G1, G2 = Group(0, "http://a:8000"), Group(1, "http://b:8000"), Group(2, "http://c:8000")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_parse_discovery_accepts_the_operators_format():
    found = parse_discovery(json.dumps({"groups": [{"group": 2, "url": "http://c:8000/"},
                                                   {"group": 0, "url": "http://a:8000"}],
                                        "model": "shoal-tiny"}))
    assert found.groups == (G0, G2) and found.model == "shoal-tiny"


@pytest.mark.parametrize("text, error", [
    ("{", "not valid JSON"),
    ("[]", "top level must be an object"),
    ('{"groups": {}}', "'groups' must be a list"),
    ('{"groups": [{"group": -1, "url": "http://a"}]}', "groups[0].group must be a non-negative"),
    ('{"groups": [{"group": 0, "url": "a:8000"}]}', "groups[0].url must be http(s)://"),
    ('{"groups": [{"group": 0, "url": "http://a"}, {"group": 0, "url": "http://b"}]}',
     "group 0 is listed twice"),
    ('{"groups": [], "model": 3}', "'model' must be a string"),
])
def test_parse_discovery_says_what_is_wrong(text, error):
    with pytest.raises(ValueError, match=error.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        parse_discovery(text)


def test_watcher_keeps_the_last_good_list_and_logs_once(tmp_path, caplog):
    path = tmp_path / "engines.json"
    seen = []
    watcher = DiscoveryWatcher(str(path), seen.append)
    watcher.check()
    assert seen == [] and "does not exist" in watcher.problem
    path.write_text(json.dumps({"groups": [{"group": 0, "url": G0.url}]}))
    watcher.check()
    assert [d.groups for d in seen] == [(G0,)] and watcher.problem is None
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="shoal.router.discovery"):
        for text in ("{broken", "{broken again"):
            path.write_text(text)
            os.utime(path, ns=(1, len(text)))  # a new mtime even on coarse clocks
            watcher.check()
            watcher.check()
    assert len(seen) == 1 and "is invalid: not valid JSON" in watcher.problem
    assert len(caplog.records) == 1  # the same problem is logged once
    assert "keeping the last good list of 1 group(s)" in caplog.text
    path.write_text(json.dumps({"groups": [{"group": 0, "url": G0.url},
                                           {"group": 1, "url": G1.url}]}))
    watcher.check()
    assert [d.groups for d in seen] == [(G0,), (G0, G1)] and watcher.problem is None


def test_picker_prefers_fewest_outstanding_and_round_robins_ties():
    picker = GroupPicker()
    picker.set_groups([G0, G1, G2])
    assert [picker.pick().id for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    picker.acquire(G0)
    picker.acquire(G1)
    assert {picker.pick().id for _ in range(3)} == {2}
    picker.acquire(G2)
    picker.acquire(G2)
    assert {picker.pick().id for _ in range(4)} == {0, 1}
    assert picker.pick(exclude={G0.key, G1.key}).id == 2


def test_picker_cooldown_skips_a_failed_group_until_it_expires():
    clock = Clock()
    picker = GroupPicker(cooldown=5.0, clock=clock)
    picker.set_groups([G0, G1])
    picker.mark_failed(G0, "could not connect")
    assert {picker.pick().id for _ in range(4)} == {1}
    picker.mark_failed(G1, "answered 503")
    assert picker.pick() is None
    why = picker.why_none()
    assert "group 0 (http://a:8000) failed: could not connect" in why and "answered 503" in why
    picker.mark_ok(G0)  # a healthy /health does not cut a cool-down short
    assert picker.pick() is None
    clock.now += 5.0  # the file still lists both: they are tried again
    assert {picker.pick().id for _ in range(4)} == {0, 1}


def test_picker_follows_the_file():
    picker = GroupPicker()
    picker.set_groups([G0, G1])
    picker.acquire(G1)
    picker.set_groups([G1, G2])
    assert sorted(picker.states) == [G1.key, G2.key] and picker.pick().id == 2
    picker.release(G1)
    picker.set_groups([])
    assert picker.pick() is None and "lists no engine groups" in picker.why_none()


@pytest.mark.process
@pytest.mark.parametrize("argv", [["router"], ["serve", "some-model", "--frontend-only"]])
def test_router_without_discovery_file_is_a_usage_error(argv):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "shoal.cli", *argv], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2
    assert "--engine-discovery-file" in r.stderr and "required" in r.stderr


def test_the_operators_frontend_command_line_selects_the_router():
    from shoal.operator.render import frontend_args
    from shoal.operator.spec import EngineSpec
    from shoal.router.main import build_parser

    spec = EngineSpec.of({"spec": {"model": "/models/tiny", "servedModelName": "shoal-tiny"}})
    argv = frontend_args(spec)
    assert argv[0] == "router"
    args = build_parser().parse_args(argv[1:])
    assert args.engine_discovery_file.endswith("/engines.json") and args.model == "/models/tiny"
    assert args.served_model_name == ["shoal-tiny"] and (args.host, args.port) == ("0.0.0.0", 8000)


def test_serve_frontend_only_is_an_alias_of_router():
    from shoal.cli import frontend_only_alias
    from shoal.router.main import build_parser

    old = ["/models/tiny", "--served-model-name", "shoal-tiny", "--frontend-only",
           "--engine-discovery-file", "/etc/shoal/discovery/engines.json", "--port", "8000"]
    args = build_parser().parse_args(frontend_only_alias(old))
    assert (args.model, args.served_model_name, args.port) == ("/models/tiny", ["shoal-tiny"], 8000)
    assert args.engine_discovery_file == "/etc/shoal/discovery/engines.json"
