"""Multi-rank engines for real: tensor-parallel groups of worker processes on one node and over
two "nodes" (two process trees joined over TCP on loopback, node 1 `--headless`), checked through
the HTTP API against transformers' greedy generate, and killed rank by rank under load: every
stream, /health, the exit codes and the termination messages name the rank that failed first,
and no process of the tree is left behind."""

from __future__ import annotations

import os
import signal
import sys
import time

import httpx
import psutil
import pytest
from multirank_helpers import (
    Oracle,
    Streams,
    assert_tree_gone,
    child_with,
    complete_all,
    process_tree,
    prompts,
    termination,
    two_node_flags,
    wait_for,
)
from support.models import ensure_model
from support.servers import ServeProcess

pytestmark = pytest.mark.process

F32 = ("--dtype", "float32")
NUM_STREAMS = 16


@pytest.fixture(scope="module")
def qwen2_model() -> str:
    return str(ensure_model("shoal-tiny-qwen2", "tiny", arch="qwen2"))


@pytest.fixture
def group(tmp_path):
    """Starts `shoal serve` processes (node 0 and headless nodes); stops them all at the end."""
    started: list[ServeProcess] = []

    def start(model: str, *flags: str, env: dict | None = None) -> ServeProcess:
        s = ServeProcess(model, tmp_path, *flags, env=env)
        started.append(s)
        return s

    yield start
    for s in reversed(started):
        s.stop(30)


@pytest.fixture
def two_nodes(group, tiny_model):
    """Starts a two-node group of the tiny model (the headless node first: it waits for node 0)
    and returns (node0, node1) once node 0 answers /health."""

    def start(tp: int, *node0_extra: str, env: dict | None = None):
        node0_flags, node1_flags = two_node_flags(tp)
        node1 = group(tiny_model, *node1_flags)
        node0 = group(tiny_model, *node0_flags, *node0_extra, env=env).wait_healthy()
        return node0, node1

    return start


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tp2_on_one_node_is_greedy_equal_to_transformers_through_http(arch, group, tiny_model,
                                                                      request):
    model = tiny_model if arch == "llama" else request.getfixturevalue("qwen2_model")
    server = group(model, *F32, "--tensor-parallel-size", "2").wait_healthy()
    workers = [p for p in psutil.Process(server.proc.pid).children(recursive=True)
               if "worker_proc" in " ".join(p.cmdline())]
    assert len(workers) == 2
    ps = prompts()
    Oracle(model).check(ps, complete_all(server, ps))


@pytest.mark.parametrize("tp", [2, 4])
def test_two_nodes_are_greedy_equal_to_transformers(tp, two_nodes, tiny_model):
    node0, node1 = two_nodes(tp)
    assert len([p for p in psutil.Process(node1.proc.pid).children(recursive=True)
                if "worker_proc" in " ".join(p.cmdline())]) == tp // 2
    ps = prompts()
    Oracle(tiny_model).check(ps, complete_all(node0, ps))
    # A clean stop of node 0 stops the headless node too, with exit code 0.
    assert node0.stop(60) == 0
    assert node1.wait_exit(30) == 0


def test_kill_9_of_a_local_worker_fails_every_stream_naming_the_rank(group, tiny_model):
    server = group(tiny_model, *F32, "--tensor-parallel-size", "2",
                   env={"SHOAL_DEAD_LINGER_S": "3"}).wait_healthy()
    tree = process_tree(server)
    streams = Streams(server, NUM_STREAMS)
    streams.wait_started()
    victim = next(p for p in tree if '"rank":1,' in " ".join(p.cmdline()))
    killed_at = time.monotonic()
    victim.kill()
    streams.join()
    for message in streams.errors():
        assert "Worker_rank1" in message and "rank 1" in message and "SIGKILL" in message
    assert max(streams.ended_at) - killed_at < 10
    health = httpx.get(f"{server.url}/health", timeout=5)
    assert health.status_code == 503 and "Worker_rank1" in health.json()["error"]["message"]
    assert server.wait_exit(60) == 1
    term = termination(server)
    assert term["rank"] == 1 and term["cause"] == "engine_error" and "SIGKILL" in term["message"]
    assert_tree_gone(tree)


def test_a_worker_that_raises_fails_every_stream_with_its_own_message(group, tiny_model):
    # Late enough that all the streams are in flight first (a stream that arrived after the
    # fault would get a plain 503, not an in-band error): 40 steps once fell short under load.
    env = {"SHOAL_ENABLE_FAULT_INJECTION": "1", "SHOAL_WORKER_FAULT": "1:400:injected rank fault",
           "SHOAL_DEAD_LINGER_S": "3"}
    server = group(tiny_model, *F32, "--tensor-parallel-size", "2", env=env).wait_healthy()
    tree = process_tree(server)
    streams = Streams(server, NUM_STREAMS)
    streams.wait_started()
    streams.join()
    for message in streams.errors():
        assert "injected rank fault" in message and "Worker_rank1" in message
    assert server.wait_exit(60) == 1
    term = termination(server)
    assert term["rank"] == 1 and "RuntimeError: injected rank fault" in term["message"]
    assert_tree_gone(tree)


def test_kill_9_of_the_headless_node_names_rank_1_on_node_1(two_nodes):
    node0, node1 = two_nodes(2, env={"SHOAL_DEAD_LINGER_S": "3"})
    tree = process_tree(node0, node1)
    streams = Streams(node0, NUM_STREAMS)
    streams.wait_started()
    killed_at = time.monotonic()
    os.kill(node1.proc.pid, signal.SIGKILL)  # the node's supervisor; its worker dies with it
    streams.join()
    for message in streams.errors():
        assert "rank 1, node 1" in message and "NodeLost" in message
    assert max(streams.ended_at) - killed_at < 15
    assert node0.wait_exit(60) == 1
    term = termination(node0)
    assert term["rank"] == 1 and term["cause"] == "peer_lost" and "node 1" in term["message"]
    assert_tree_gone(tree)


def test_kill_9_of_the_engine_core_stops_the_headless_node_within_10_s(two_nodes):
    node0, node1 = two_nodes(4, env={"SHOAL_DEAD_LINGER_S": "3"})
    tree = process_tree(node0, node1)
    streams = Streams(node0, NUM_STREAMS)
    streams.wait_started()
    engine = child_with(node0, "engine_core_proc")
    killed_at = time.monotonic()
    engine.kill()
    streams.join()
    for message in streams.errors():
        assert "EngineCore_0" in message and "rank 0" in message and "SIGKILL" in message
    assert node0.wait_exit(60) == 1
    assert termination(node0)["rank"] == 0
    assert node1.wait_exit(15) == 1
    assert time.monotonic() - killed_at < 15
    term = termination(node1)
    assert term["cause"] == "peer_lost" and "node 0" in term["message"]
    assert_tree_gone(tree)


def test_a_headless_node_exits_within_10_s_when_node_0_becomes_unreachable(two_nodes):
    """Node 0 frozen (SIGSTOP of its whole tree: no heartbeat, no connection reset) is what an
    unreachable node looks like from node 1."""
    node0, node1 = two_nodes(2)
    tree0, tree1 = process_tree(node0), process_tree(node1)
    stopped_at = time.monotonic()
    for p in tree0:
        p.suspend()
    try:
        assert node1.wait_exit(15) == 1
        assert time.monotonic() - stopped_at < 10
        term = termination(node1)
        assert term["cause"] == "peer_lost" and "no heartbeat" in term["message"]
        assert_tree_gone(tree1)
    finally:
        for p in tree0:
            p.kill()


def test_sigterm_to_the_headless_node_alone_drains_the_group_from_node_0(two_nodes):
    """SIGTERM to a headless node asks node 0 to shut the group down: node 0 drains by its
    --shutdown-timeout (in-flight streams finish, new requests get 503) while the headless node
    keeps serving its shard; then every process exits 0."""
    node0, node1 = two_nodes(2, "--shutdown-timeout", "120")
    tree = process_tree(node0, node1)
    streams = Streams(node0, 4, max_tokens=60)
    streams.wait_started()
    node1.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: _status(f"{node0.url}/health") in (503, None), 30,
             what="node 0 to start draining")
    streams.join()
    assert streams.finish_reasons() == ["length"] * 4
    assert node0.wait_exit(60) == 0
    assert node1.wait_exit(30) == 0
    assert_tree_gone(tree)


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return None


def test_the_operators_rendered_command_lines_start_a_two_node_group(tmp_path, tiny_model):
    """The contract with the operator: the exact args render.py gives each rank pod start a real
    group (only what a pod would resolve differently is substituted: the model's mount path, the
    rank-0 DNS name, the ports)."""
    from shoal.operator import render
    from shoal.operator.spec import parse
    from support.net import free_port
    from support.servers import ServerProcess

    body = {"apiVersion": "shoal.dev/v1alpha1", "kind": "InferenceEngine",
            "metadata": {"name": "demo", "namespace": "ns", "uid": "u1"},
            "spec": {"model": "/models/tiny", "tensorParallelSize": 2, "nodesPerGroup": 2}}
    _, flags = two_node_flags(2)
    master_port = flags[flags.index("--master-port") + 1]
    http_port = free_port()
    subst = {"/models/tiny": tiny_model, render.L.rank_host("demo", "ns", 0, 0): "127.0.0.1",
             str(render.L.DEFAULT_MASTER_PORT): master_port,
             str(render.L.HTTP_PORT): str(http_port)}
    env = {**os.environ, "SHOAL_KV_CACHE_SPACE": "0.0625"}
    procs = []
    try:
        for rank in (1, 0):
            args = [subst.get(a, a) for a in render.engine_args(*parse(body), 0, rank)]
            env_r = {**env, "SHOAL_TERMINATION_LOG": str(tmp_path / f"term-{rank}")}
            p = ServerProcess([sys.executable, "-m", "shoal.cli", *args],
                              tmp_path / f"rank{rank}.log", env_r, None)
            p.port = http_port
            procs.append(p)
        node0 = procs[1].wait_answering("/health", "rank 0 of the rendered group", 300)
        r = httpx.post(f"{node0.url}/v1/completions", timeout=120,
                       json={"model": tiny_model, "prompt": "def f(", "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert procs[1].stop(60) == 0  # drain (timeoutSeconds 30 rendered), then stop
        assert procs[0].proc.wait(30) == 0
    finally:
        for p in procs:
            p.stop(10)


def test_kill_9_of_the_frontend_leaves_no_process_of_either_node(two_nodes):
    node0, node1 = two_nodes(2)
    tree = process_tree(node0, node1)
    os.kill(node0.proc.pid, signal.SIGKILL)  # EngineCore's watchdog, then parent-death signals
    assert node1.wait_exit(15) == 1
    assert termination(node1)["cause"] == "peer_lost"
    assert_tree_gone(tree)
