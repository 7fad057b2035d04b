"""The migration suite: command lines and requests written the way widely used manifests and
clients write them, against a real `shoal serve` on the project's model. Each command line
must start and answer, or be refused at start-up (exit 2, a termination message naming the
flag and why); the clients are the real packages (LangChain's ChatOpenAI, the OpenAI Agents
SDK, in their own cached venv: peer_tools.py). Only the model path, host and port differ from
the sources' text. Traffic stays on 127.0.0.1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from peer_tools import ensure_clients
from support.servers import MODEL_NAME, ServeProcess

pytestmark = pytest.mark.process

# (source, the flags as the source writes them after `vllm serve MODEL`, what must happen).
SERVES = "serves"
COMMAND_LINES = [
    ("vLLM docs, Kubernetes deployment",
     ["--trust-remote-code", "--enable-chunked-prefill", "--max_num_batched_tokens", "1024"],
     SERVES),
    ("production-stack chart (vllmConfig + extraArgs)",
     ["--host", "0.0.0.0", "--port", "8000", "--max-model-len", "2048", "--dtype", "bfloat16",
      "--disable-log-requests", "--gpu-memory-utilization", "0.8", "--enable-prefix-caching",
      "--max-num-seqs", "32", "--tensor-parallel-size", "1"], SERVES),
    ("LWS / KServe style single node",
     ["--port", "8080", "--tensor-parallel-size", "1", "--max-model-len", "2k",
      "--enforce-eager", "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log"],
     SERVES),
    ("vLLM's API key by flag, several keys", ["--api-key", "k1", "k2"], SERVES),
    ("a Qwen3 deployment's tools", ["--enable-auto-tool-choice", "--tool-call-parser",
                                     "qwen3_coder"], SERVES),
    # The project's model has no <think> tokens: refused at start-up, as vLLM refuses it.
    ("a Qwen3 deployment's reasoning", ["--reasoning-parser", "qwen3"], "--reasoning-parser"),
    # vLLM's Llama 3.1 tool-calling example; the project's model has no <|python_tag|>.
    ("a Llama 3.1 deployment's tools", ["--enable-auto-tool-choice", "--tool-call-parser",
                                         "llama3_json"], "--tool-call-parser"),
    ("llm-d decode pod (NIXL KV transfer)",
     ["--port", "8200", "--enforce-eager", "--block-size", "64", "--kv-transfer-config",
      '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'], "--kv-transfer-config"),
    ("an AWQ checkpoint's manifest", ["--quantization", "awq", "--max-model-len", "4096"],
     "--quantization"),
]


def _strip_address(flags: list[str]) -> list[str]:
    """The manifest's flags without --host/--port (the test picks a free loopback port)."""
    out, skip = [], False
    for f in flags:
        if skip:
            skip = False
        elif f in ("--host", "--port"):
            skip = True
        else:
            out.append(f)
    return out


@pytest.mark.parametrize("source,flags,expect", COMMAND_LINES, ids=[c[0] for c in COMMAND_LINES])
def test_a_manifests_command_line_serves_or_is_refused_naming_the_flag(
        tiny_model, tmp_path, source, flags, expect):
    server = ServeProcess(tiny_model, tmp_path, *_strip_address(flags))
    try:
        if expect == SERVES:
            server.wait_healthy()
            headers = {"Authorization": "Bearer k2"} if "--api-key" in flags else {}
            r = httpx.post(f"{server.url}/v1/chat/completions", headers=headers, timeout=60,
                           json={"model": MODEL_NAME, "max_tokens": 4,
                                 "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200, (source, r.text, server.log()[-2000:])
            return
        code = server.wait_exit(120)
        message = json.loads(server.termination_log.read_text())
        assert code == 2 and message["cause"] == "config_error", (source, message)
        assert expect in message["message"], (source, message["message"])
    finally:
        server.stop()


@pytest.fixture(scope="module")
def clients():
    return ensure_clients()


def _run_client(bin_dir: Path, script: str, url: str) -> dict:
    env = {**os.environ, "OPENAI_AGENTS_DISABLE_TRACING": "1", "DO_NOT_TRACK": "1",
           "OPENAI_API_KEY": "EMPTY"}
    proc = subprocess.run([str(bin_dir / "python"), "-c", script, f"{url}/v1", MODEL_NAME],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


LANGCHAIN = '''
import json, sys
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
url, model = sys.argv[1], sys.argv[2]
llm = ChatOpenAI(base_url=url, api_key="EMPTY", model=model, max_tokens=8, temperature=0,
                 max_retries=0)
out = llm.invoke("hi")
chunks = list(llm.stream("hi"))
@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return "sunny"
called = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("weather in Paris?")
names = [c["name"] for c in called.tool_calls] + [c["name"] for c in called.invalid_tool_calls]
print(json.dumps({"content": out.content, "chunks": len(chunks), "tool_names": names}))
'''

AGENTS = '''
import asyncio, json, sys
from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
from openai import AsyncOpenAI
url, model = sys.argv[1], sys.argv[2]
set_tracing_disabled(True)
client = AsyncOpenAI(base_url=url, api_key="EMPTY", max_retries=0)
agent = Agent(name="a", instructions="Be brief.", model_settings=ModelSettings(max_tokens=8),
              model=OpenAIChatCompletionsModel(model=model, openai_client=client))
async def main():
    plain = (await Runner.run(agent, "hi")).final_output
    streamed = Runner.run_streamed(agent, "hi")
    async for _ in streamed.stream_events():
        pass
    return {"plain": plain, "streamed": streamed.final_output}
print(json.dumps(asyncio.run(main())))
'''


def test_langchain_chat_openai_invokes_streams_and_calls_a_tool(clients, engine):
    out = _run_client(clients, LANGCHAIN, engine.url)
    assert out["content"] and out["chunks"] >= 2
    # A forced call on a random model may be cut by max_tokens: LangChain still sees the call.
    assert out["tool_names"] == ["get_weather"], out


def test_the_openai_agents_sdk_runs_plain_and_streamed(clients, engine):
    out = _run_client(clients, AGENTS, engine.url)
    assert out["plain"] and out["streamed"], out


def test_the_clients_venv_is_not_the_test_venv(clients):
    assert Path(sys.prefix) != clients.parent
