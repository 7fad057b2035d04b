"""The real peer software of a vLLM deployment, from the package index (peer_tools.py), in
front of and against a real `shoal serve` on the project's model, every request answered:
vLLM's router (`vllm-router`) and SGLang's (`sglang-router`) relay chat (streamed and not) and
completions bodies with the fields they inject; a short `guidellm` run (chat, streamed, with
`continuous_usage_stats`) finishes with zero errors. Traffic stays on 127.0.0.1."""

from __future__ import annotations

import json
import os

import httpx
import pytest
from peer_tools import command, ensure_peer_tools
from support.net import free_port
from support.servers import MODEL_NAME, ServerProcess

pytestmark = pytest.mark.process

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
COMPLETION = {"model": MODEL_NAME, "prompt": "def fibonacci(n):", "max_tokens": 5}


@pytest.fixture(scope="module")
def peers():
    return ensure_peer_tools()


def _router(argv: list[str], tmp, port: int) -> ServerProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1"}
    r = ServerProcess(argv, tmp / f"peer-{port}.log", env, None)
    r.port = port
    return r


def _relays_every_shape(url: str) -> None:
    with httpx.Client(base_url=url, timeout=60) as c:
        chat = c.post("/v1/chat/completions", json=CHAT)
        assert chat.status_code == 200, chat.text
        assert chat.json()["choices"][0]["message"]["content"]
        done = c.post("/v1/completions", json=COMPLETION)
        assert done.status_code == 200, done.text
        assert done.json()["usage"]["completion_tokens"] == 5
        with c.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as s:
            assert s.status_code == 200
            lines = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and not any('"error"' in x for x in lines)


@pytest.mark.parametrize("which", ["vllm-router", "sglang-router"])
def test_a_peer_router_relays_every_request_to_shoal(peers, engine, tmp_path, which):
    port, metrics = free_port(), free_port()
    if which == "vllm-router":
        argv = [*command(peers, "vllm-router"), "--host", "127.0.0.1", "--port", str(port),
                "--worker-urls", engine.url, "--policy", "round_robin",
                "--prometheus-port", str(metrics)]
    else:
        argv = [str(peers / "python"), "-m", "sglang_router.launch_router", "--host",
                "127.0.0.1", "--port", str(port), "--worker-urls", engine.url, "--policy",
                "round_robin", "--prometheus-port", str(metrics)]
    router = _router(argv, tmp_path, port)
    try:
        router.wait_answering("/health", f"{which} to answer", 60)
        _relays_every_shape(router.url)
    finally:
        router.stop(10)


def test_a_short_guidellm_run_has_no_errors(peers, engine, tmp_path, tiny_model):
    out = tmp_path / "guidellm.json"
    run = _router([*command(peers, "guidellm"), "run",
                   "--backend", f"kind=openai_http,target={engine.url},model={MODEL_NAME},"
                                "request_format=/v1/chat/completions",
                   "--profile", "kind=synchronous",
                   "--constraint", "kind=max_requests,count=6",
                   "--tokenizer", f"kind=huggingface_auto,model={tiny_model}",
                   "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=8",
                   "--output", f"kind=json,path={out}", "--disable-console-interactive"],
                  tmp_path, 0)
    run.proc.wait(300)
    assert run.proc.returncode == 0, run.log()[-3000:]
    made = json.loads(out.read_text())["benchmarks"][0]["scheduler_metrics"]["requests_made"]
    assert made == {"successful": 6, "errored": 0, "incomplete": 0, "total": 6}, made
