"""/metrics as vLLM's: the token counters move with every engine step (read mid-stream), and
the request phase histograms (queue, prefill, decode, inference) and tokens-per-step have
observations after a request, with values that fit together."""

from __future__ import annotations

import re

import httpx
import pytest
from support.servers import MODEL_NAME, ServeProcess
from support.wait import wait_for

pytestmark = pytest.mark.process

LONG = 1000  # tokens: seconds of decoding on this machine, so the read lands mid-stream


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    s = ServeProcess(tiny_model, tmp_path_factory.mktemp("metrics"))
    try:
        yield s.wait_healthy()
    finally:
        s.stop()


def scrape(server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    values = {}
    for line in text.splitlines():
        m = re.match(r"^(vllm:[a-z0-9_]+)(\{[^}]*\})? (\S+)$", line)
        if m and 'le="' not in (m.group(2) or ""):
            values[m.group(1)] = float(m.group(3))
    return values


def test_token_counters_move_while_a_request_streams(server):
    before = scrape(server)
    prompt = list(range(100, 117))
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": LONG, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        chunks = 0
        for line in lines:
            if line.startswith("data: {"):
                chunks += 1
                if chunks == 3:
                    break
        mid = scrape(server)
    # Closing the stream aborted the request: it never reached its end during the read.
    assert mid["vllm:prompt_tokens_total"] - before.get("vllm:prompt_tokens_total", 0) == 17
    generated = mid["vllm:generation_tokens_total"] - before.get("vllm:generation_tokens_total", 0)
    assert 3 <= generated < LONG
    assert mid["vllm:iteration_tokens_total_count"] > before.get(
        "vllm:iteration_tokens_total_count", 0)
    wait_for(lambda: scrape(server)["vllm:num_requests_running"] == 0, 30,
             what="the aborted request to leave the engine")


def test_phase_histograms_observe_each_request(server):
    before = scrape(server)
    r = httpx.post(f"{server.url}/v1/completions", json={
        "model": MODEL_NAME, "prompt": "def main(", "max_tokens": 12, "temperature": 0,
        "ignore_eos": True}, timeout=60)
    assert r.status_code == 200
    after = scrape(server)

    def delta(name):
        return after[name] - before.get(name, 0.0)

    for phase in ("queue", "prefill", "decode", "inference"):
        assert delta(f"vllm:request_{phase}_time_seconds_count") == 1, phase
    prefill, decode = delta("vllm:request_prefill_time_seconds_sum"), \
        delta("vllm:request_decode_time_seconds_sum")
    inference, e2e = delta("vllm:request_inference_time_seconds_sum"), \
        delta("vllm:e2e_request_latency_seconds_sum")
    queue = delta("vllm:request_queue_time_seconds_sum")
    assert prefill > 0 and decode > 0 and queue >= 0
    assert inference == pytest.approx(prefill + decode, abs=1e-6)
    assert queue + inference <= e2e + 1e-6
    # Tokens per step: one step carried the prompt and the first token, 11 steps one token each.
    assert delta("vllm:iteration_tokens_total_sum") == r.json()["usage"]["total_tokens"]
    assert delta("vllm:generation_tokens_total") == 12
