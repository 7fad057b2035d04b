"""Failure paths across the process boundary: every one names the process and the root cause,
in the exception, the HTTP error, /health, the exit code and the termination message."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import psutil
import pytest
import zmq
from shoal.engine import wire
from shoal.engine.config import EngineConfig
from shoal.engine.core_client.async_client import AsyncMPClient
from shoal.engine.errors import EngineDeadError, EngineStartupError
from support.servers import MODEL_NAME
from support.wait import wait_for

pytestmark = pytest.mark.process

HERE = Path(__file__).parent


def test_protocol_mismatch_fails_start_up_naming_both_versions(tiny_model):
    env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    started = time.monotonic()
    with pytest.raises(EngineStartupError) as err:
        AsyncMPClient(EngineConfig(model=tiny_model), engine_module="fake_engine_wrong_protocol",
                      env=env)
    msg = str(err.value)
    assert f"frontend v{wire.PROTOCOL_VERSION}" in msg
    assert f"engine v{wire.PROTOCOL_VERSION + 1}" in msg and "9.9.9" in msg
    assert time.monotonic() - started < 30  # fails at HELLO, not after a model load


async def _run_to_finish(client: AsyncMPClient, request_id: str) -> list[int]:
    tokens: list[int] = []
    while True:
        step = await client.get_output_async()
        tokens += [t for r, t in zip(step.decode_req_ids, step.decode_token_ids, strict=True)
                   if r == request_id]
        for out in step.outputs:
            if out.request_id == request_id:
                tokens += out.new_token_ids
                if out.finish_reason is not None:
                    return tokens


async def test_client_serves_then_reports_an_engine_exception_with_its_root_cause(
        tiny_model, tmp_path):
    term = tmp_path / "termination-log"
    # Over tcp:// (as across hosts): the frontend binds on the host, the engine connects.
    client = AsyncMPClient(
        EngineConfig(model=tiny_model, kv_cache_memory_bytes=64 << 20), host="127.0.0.1",
        env={"SHOAL_ENABLE_FAULT_INJECTION": "1", "SHOAL_TERMINATION_LOG": str(term)})
    client.start()
    try:
        assert client.engine.input.getsockopt_string(zmq.LAST_ENDPOINT).startswith("tcp://")
        assert client.max_model_len == 2048 and client.num_blocks > 1
        params = wire.SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        await client.add_request_async(
            wire.EngineCoreRequest("r1", [0, 40, 41, 42], params, time.time()))
        assert len(await _run_to_finish(client, "r1")) == 5
        stats = await client.call_utility_async("get_kv_stats")
        assert stats["num_blocks"] == client.num_blocks
        assert await client.call_utility_async("ping") == "pong"
        with pytest.raises(RuntimeError, match="not allowed"):
            await client.call_utility_async("shutdown")
        # A request the engine refuses comes back as a rejection, the engine lives on.
        await client.add_request_async(wire.EngineCoreRequest("bad", [], params, time.time()))
        rejected = None
        while rejected is None:
            rejected = (await client.get_output_async()).rejected
        assert rejected[0].status == 400 and "empty" in rejected[0].message

        with pytest.raises(EngineDeadError):
            await client.call_utility_async("fail_for_test", "injected boom")
        with pytest.raises(EngineDeadError) as err:
            while True:  # the outputs still queued, then the death
                await client.get_output_async()
        dead = err.value.dead
        assert dead.process == "EngineCore_0" and dead.rank == 0
        assert dead.exc_type == "RuntimeError" and dead.message == "injected boom"
        assert "in _utility" in dead.traceback and "Traceback" in dead.traceback
        assert client.engine.proc.wait(30) == 1
        message = json.loads(term.read_text())
        assert message["cause"] == "engine_error" and "injected boom" in message["message"]
        assert "EngineCore_0" in message["message"]
    finally:
        client.shutdown()


def test_start_up_failure_exits_1_with_the_engines_own_error(serve_factory):
    server = serve_factory("--num-gpu-blocks-override", "2")
    assert server.wait_exit(180) == 1
    message = json.loads(server.termination_log.read_text())  # the pod's status says it all
    assert message["cause"] == "config_error" and "KV cache holds" in message["message"]
    assert "EngineCore_0" in message["message"] and "ConfigError" in message["message"]


def test_bad_flags_exit_2_with_a_clear_message(serve_factory):
    server = serve_factory("--pipeline-parallel-size", "2")
    assert server.wait_exit(60) == 2
    message = json.loads(server.termination_log.read_text())
    assert "--pipeline-parallel-size 2 is not implemented" in message["message"]
    assert message["cause"] == "config_error"


def test_sigkilled_engine_fails_requests_with_its_name_and_the_server_exits_1(serve_factory):
    server = serve_factory(env={"SHOAL_DEAD_LINGER_S": "6"}).wait_healthy()
    body = {"model": MODEL_NAME, "prompt": "def f(", "max_tokens": 1900, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        os.kill(server.engine_pid(), signal.SIGKILL)
        rest = [line[6:] for line in lines if line.startswith("data: ")]
    assert rest[-1] == "[DONE]"
    error = json.loads(rest[-2])["error"]
    assert error["type"] == "EngineDeadError" and error["code"] == 500
    assert "EngineCore_0" in error["message"] and "SIGKILL" in error["message"]

    health = wait_for(lambda: _status(f"{server.url}/health") == 503 and
                      httpx.get(f"{server.url}/health"), 10, what="/health to say 503")
    assert "EngineCore_0" in health.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "a"}, timeout=10)
    assert r.status_code == 500 and "EngineCore_0" in r.json()["error"]["message"]
    assert server.wait_exit(60) == 1
    message = json.loads(server.termination_log.read_text())
    assert message["cause"] == "engine_error" and "SIGKILL" in message["message"]


def test_the_engine_exits_when_its_frontend_is_killed(serve_factory):
    """SIGKILL the frontend (its own server); the engine's watchdog must notice."""
    server = serve_factory().wait_healthy()
    engine = psutil.Process(server.engine_pid())
    os.kill(server.proc.pid, signal.SIGKILL)
    wait_for(lambda: not engine.is_running() or engine.status() == psutil.STATUS_ZOMBIE, 30,
             what="the orphaned engine process to exit")


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return None
