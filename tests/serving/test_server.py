"""The OpenAI-compatible server, end to end: the official `openai` client against one real
`shoal serve` subprocess (frontend process + EngineCore process) shared by this module."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys

import httpx
import openai
import psutil
import pytest
from support.servers import API_KEY, MODEL_NAME, healthy_server
from support.wait import wait_for

pytestmark = pytest.mark.process

IGNORE_EOS = {"ignore_eos": True}
PROMPTS = ["def main(", "import os\nimport sys\n", "class Parser:\n    def"]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    with healthy_server(tiny_model, tmp_path_factory, api_key=API_KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture
def aclient(server):
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                              timeout=120)


def greedy(client, prompt, max_tokens=16, **extra):
    return client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens,
                                     temperature=0, extra_body={**IGNORE_EOS, **extra})


def test_the_engine_takes_every_usable_cpu_by_default(server):
    """No --num-threads: `shoal serve` gives the engine rank the CPUs this process may use
    (affinity and cgroup limit, cpus.py), and the engine process logs what it took."""
    from shoal.engine.worker.cpu.cpus import usable_cpus

    assert f"rank 0: {usable_cpus()} torch threads" in server.log()


def test_the_engine_says_whether_its_idle_openmp_threads_sleep(server):
    """Set before torch loads OpenMP in the engine process (cpus.omp_wait_env: sleep unless
    pinned to CPUs of its own or told otherwise), and logged with the reason."""
    from shoal.engine.worker.cpu.cpus import omp_wait_env

    env, why = omp_wait_env()
    policy = env.get("OMP_WAIT_POLICY", os.environ.get("OMP_WAIT_POLICY", "unset"))
    assert why in server.log()
    assert f"torch threads (OMP_WAIT_POLICY {policy})" in server.log()


def test_a_cpu_server_takes_vllms_batch_defaults_and_says_so(server):
    """No --max-num-seqs or --max-num-batched-tokens on the CPU: vLLM's API-server defaults
    there (128 seats, 2048 tokens a step), in the start-up log line."""
    assert "128 seats, 2048 tokens per step" in server.log()


def test_batch_defaults_follow_the_device_the_group_and_the_performance_mode():
    from shoal.engine.config import ConfigError, serving_batch_defaults

    assert serving_batch_defaults("cpu", 1) == (128, 2048)
    assert serving_batch_defaults("cpu", 2) == (256, 4096)  # per rank, as vLLM's
    assert serving_batch_defaults("cpu", 1, "throughput") == (256, 4096)
    assert serving_batch_defaults("cuda", 1) == (256, 2048)
    assert serving_batch_defaults("cuda:1", 4, "throughput") == (512, 4096)
    with pytest.raises(ConfigError, match="interactivity"):
        serving_batch_defaults("cpu", 1, "interactivity")


# ----- completions and chat ---------------------------------------------------------------


def test_completion_returns_exactly_max_tokens_with_usage(client):
    r = greedy(client, "def main(", max_tokens=12)
    assert r.object == "text_completion" and r.model == MODEL_NAME
    assert r.choices[0].finish_reason == "length" and r.choices[0].text
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_chat_completion_answers_as_assistant(client):
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hello"}], max_tokens=8,
        temperature=0, extra_body=IGNORE_EOS)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens > 3


def test_streamed_completion_equals_the_non_streamed_one(client):
    full = greedy(client, PROMPTS[1], max_tokens=20).choices[0].text
    stream = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=IGNORE_EOS)
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_stream_has_role_delta_content_finish_usage_and_done(server):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 6, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body,
                      headers=server.headers, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


def test_chat_stream_without_include_usage_sends_no_usage_chunk(client):
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        stream=True, extra_body=IGNORE_EOS))
    assert all(c.usage is None and c.choices for c in chunks)


def test_stop_string_cuts_the_text_and_finishes_with_stop(client):
    full = greedy(client, PROMPTS[0], max_tokens=24).choices[0].text
    # A stop string from the middle of the greedy text: the answer must end right before it.
    mid = len(full) // 2
    stop = full[mid:mid + 3]
    if not stop.strip():
        stop = full[mid:mid + 5]
    expected = full[: full.index(stop)]
    r = greedy(client, PROMPTS[0], max_tokens=24, stop=[stop])
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop],
        stream=True, extra_body=IGNORE_EOS)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(client):
    def sample(seed):
        return client.completions.create(model=MODEL_NAME, prompt="x = ", max_tokens=16,
                                         temperature=1.0, seed=seed,
                                         extra_body=IGNORE_EOS).choices[0].text

    a, b = sample(7), sample(7)
    assert a == b
    assert any(sample(s) != a for s in (8, 9, 10))


def test_n_greater_than_one_returns_n_choices(client):
    r = client.completions.create(model=MODEL_NAME, prompt="for i in", max_tokens=5, n=3,
                                  temperature=1.0, seed=1, extra_body=IGNORE_EOS)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 15


async def test_64_concurrent_streams_all_complete_with_exact_token_counts(aclient):
    async def one(i):
        stream = await aclient.completions.create(
            model=MODEL_NAME, prompt=f"value_{i} = ", max_tokens=10 + i % 7, temperature=0.8,
            seed=i, stream=True, stream_options={"include_usage": True}, extra_body=IGNORE_EOS)
        usage, finish = None, None
        async for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            for c in chunk.choices:
                finish = c.finish_reason or finish
        return usage.completion_tokens, finish

    results = await asyncio.gather(*(one(i) for i in range(64)))
    assert results == [(10 + i % 7, "length") for i in range(64)]


def test_greedy_http_output_equals_offline_llm_generate(client, tiny_model):
    from shoal.engine.llm import LLM
    from shoal.engine.wire import SamplingParams

    llm = LLM(tiny_model, kv_cache_memory_bytes=64 << 20)
    try:
        offline = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20,
                                                       ignore_eos=True))
    finally:
        llm.shutdown()
    for prompt, ref in zip(PROMPTS, offline, strict=True):
        r = greedy(client, prompt, max_tokens=20)
        assert r.choices[0].text == ref.outputs[0].text
        assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)


def test_slow_consumer_gets_every_token_exactly_once(server, client):
    """Read one chunk, then wait until the engine has finished the whole request before reading
    on: everything produced meanwhile must arrive (merged), none of it twice."""
    full = greedy(client, PROMPTS[2], max_tokens=48).choices[0].text
    done_before = server.metric("vllm:request_success_total", 'finished_reason="length"')
    body = {"model": MODEL_NAME, "prompt": PROMPTS[2], "max_tokens": 48, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                      headers=server.headers, timeout=60) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        wait_for(lambda: server.metric("vllm:request_success_total",
                                       'finished_reason="length"') > done_before,
                 60, what="the engine to finish the request")
        rest = [line for line in lines if line.startswith("data: ")]
    chunks = [json.loads(e[6:]) for e in [first, *rest] if e != "data: [DONE]"]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == full
    assert chunks[-1]["usage"]["completion_tokens"] == 48


def test_client_disconnect_mid_stream_frees_its_kv_blocks(server):
    """Several times over: a relay between app and server once hid the disconnect from the
    response in one try of three to fifteen, and the request then generated to its end."""
    body = {"model": MODEL_NAME, "prompt": "while True:" * 40, "max_tokens": 1500,
            "temperature": 0, "ignore_eos": True, "stream": True}
    aborts_at_start = server.metric("vllm:request_success_total", 'finished_reason="abort"')
    for attempt in range(10):
        aborted_before = server.metric("vllm:request_success_total", 'finished_reason="abort"')
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                          headers=server.headers, timeout=60) as r:
            lines = r.iter_lines()  # (breaking out of iter_lines would close the connection early)
            next(line for line in lines if line.startswith("data: "))
            wait_for(lambda: server.metric("vllm:kv_cache_usage_perc") > 0, 30,
                     what="the running request to hold KV blocks",
                     detail=lambda: [m for m in httpx.get(f"{server.url}/metrics").text.splitlines()
                                     if m.startswith(("vllm:num_req", "vllm:kv"))])
        # The response is closed: the server must abort the request and the engine free its blocks
        # (well before the 1500 tokens would have ended it: about 14 s here).
        wait_for(lambda before=aborted_before: server.metric(
                     "vllm:request_success_total", 'finished_reason="abort"') > before, 5,
                 what=f"the frontend to abort the request (attempt {attempt})",
                 detail=lambda: [m for m in httpx.get(f"{server.url}/metrics").text.splitlines()
                                 if m.startswith("vllm:request_success_total")])
        wait_for(lambda: server.metric("vllm:num_requests_running") == 0
                 and server.metric("vllm:kv_cache_usage_perc") == 0, 30,
                 what="the engine to free the request's KV blocks",
                 detail=lambda: [m for m in httpx.get(f"{server.url}/metrics").text.splitlines()
                                 if m.startswith(("vllm:num_req", "vllm:kv", "vllm:request_succ"))])
    assert server.metric("vllm:request_success_total",
                         'finished_reason="abort"') >= aborts_at_start + 10


# ----- bad input: the right 4xx, a message that says what to fix, nothing else lost ----------

TOO_LONG = list(range(10, 2100))
BAD_REQUESTS = [
    ("malformed JSON", "/v1/completions", b'{"model": "tiny", "prompt": ', 400, "not valid JSON"),
    ("prompt of the wrong type", "/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("max_tokens not a number", "/v1/completions", {"prompt": "a", "max_tokens": "ten"}, 400,
     "max_tokens"),
    ("negative max_tokens", "/v1/completions", {"prompt": "a", "max_tokens": -1}, 400,
     "max_tokens must be at least 1"),
    ("huge max_tokens", "/v1/completions", {"prompt": "a", "max_tokens": 10**6}, 400,
     "maximum context length is 2048"),
    ("too-long prompt", "/v1/completions", {"prompt": TOO_LONG, "max_tokens": 1}, 400,
     "maximum context length is 2048"),
    ("token id outside the vocabulary", "/v1/completions", {"prompt": [1, 10**7]}, 400,
     "outside the vocabulary"),
    ("negative temperature", "/v1/completions", {"prompt": "a", "temperature": -1}, 400,
     "temperature"),
    ("top_p above 1", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "a"}], "top_p": 2}, 400, "top_p"),
    ("n of zero", "/v1/completions", {"prompt": "a", "n": 0}, 400, "n must be"),
    ("logprobs above 20", "/v1/completions", {"prompt": "a", "logprobs": 21}, 400,
     "logprobs must be between 0 and 20"),
    ("no messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("unknown role", "/v1/chat/completions", {"messages": [{"role": "x", "content": "a"}]}, 400,
     "role"),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "a"}, 404,
     "`gpt-9` does not exist"),
]


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_input_gets_a_4xx_that_says_what_to_fix(server, case):
    _, path, body, status, fragment = case
    if isinstance(body, dict):
        body = json.dumps({"model": MODEL_NAME, **body}).encode()
    r = httpx.post(f"{server.url}{path}", content=body, timeout=30,
                   headers={**server.headers, "content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert fragment in err["message"] and err["code"] == status and err["type"]


def test_openai_client_sees_bad_request_and_not_found_errors(client):
    with pytest.raises(openai.BadRequestError, match="maximum context length is 2048"):
        client.completions.create(model=MODEL_NAME, prompt=TOO_LONG, max_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="a", max_tokens=4)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}])
def test_missing_or_wrong_api_key_is_401(server, headers):
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "a"}, headers=headers)
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200  # probes need no key


async def test_bad_requests_do_not_disturb_a_stream_in_flight(aclient, server):
    stream = await aclient.completions.create(
        model=MODEL_NAME, prompt="def f(", max_tokens=40, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=IGNORE_EOS)
    async with httpx.AsyncClient(headers=server.headers) as http:
        for _, path, body, status, _ in BAD_REQUESTS:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = await http.post(f"{server.url}{path}", content=data,
                                headers={"content-type": "application/json"})
            assert r.status_code == status
    usage = [c.usage async for c in stream if c.usage]
    assert usage[0].completion_tokens == 40


# ----- the rest of the surface ---------------------------------------------------------------


def test_models_version_and_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert httpx.get(f"{server.url}/version").json()["version"]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_tokenize_and_detokenize_round_trip(server):
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "print('hello')"}).json()
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 2048
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": r["tokens"][1:]}).json()
    assert text["prompt"] == "print('hello')"
    chat = httpx.post(f"{server.url}/tokenize",
                      json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 3
    bad = httpx.post(f"{server.url}/detokenize", json={"tokens": [-1]})
    assert bad.status_code == 400


def test_metrics_use_vllm_names_and_labels(server, client):
    greedy(client, "a", max_tokens=3)
    text = httpx.get(f"{server.url}/metrics").text
    for name in ["vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:num_preemptions_total",
                 "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket",
                 "vllm:request_queue_time_seconds_bucket"]:
        lines = [line for line in text.splitlines() if line.startswith(name + "{")]
        assert lines and all('engine="0"' in line and f'model_name="{MODEL_NAME}"' in line
                             for line in lines), name
    assert re.search(r'^vllm:request_success_total\{.*finished_reason="length".*\} [1-9]', text,
                     re.M)


def test_metrics_take_prometheus_name_filter(server, client):
    """`name[]` query parameters (prometheus_client's filter, as vLLM's /metrics takes them)
    return those series alone: what a router's prober asks for every round."""
    greedy(client, "a", max_tokens=3)
    names = ["vllm:num_requests_running", "vllm:kv_cache_usage_perc",
             "vllm:request_success_total", "vllm:time_to_first_token_seconds_count"]
    text = httpx.get(f"{server.url}/metrics", params={"name[]": names}).text
    samples = {line.split("{")[0].split(" ")[0] for line in text.splitlines()
               if line and not line.startswith("#")}
    assert samples == set(names)
    assert re.search(r'^vllm:request_success_total\{.*finished_reason="length".*\} [1-9]', text,
                     re.M)
    assert len(text) * 10 < len(httpx.get(f"{server.url}/metrics").text)


def test_serve_help_explains_every_vllm_flag():
    out = subprocess.run([sys.executable, "-m", "shoal.cli", "serve", "--help"],
                         capture_output=True, text=True, check=True).stdout
    for flag in ["--host", "--port", "--served-model-name", "--max-model-len", "--max-num-seqs",
                 "--max-num-batched-tokens", "--block-size", "--enable-prefix-caching",
                 "--no-enable-prefix-caching", "--dtype", "--seed", "--api-key",
                 "--shutdown-timeout", "--kv-cache-memory-bytes", "--tensor-parallel-size",
                 "--headless", "--nnodes", "--node-rank", "--master-addr", "--master-port",
                 "--performance-mode"]:
        assert flag in out, flag


def test_the_api_server_process_does_not_load_torch(server):
    """Only the engine process pays for torch; the frontend tokenizes with `tokenizers`."""
    frontend = [m.path for m in psutil.Process(server.proc.pid).memory_maps()]
    engine = [m.path for m in psutil.Process(server.engine_pid()).memory_maps()]
    assert any("libtorch" in p for p in engine)
    assert not any("libtorch" in p for p in frontend)


def test_a_vllm_manifests_key_and_generation_config_are_honoured(tiny_model, tmp_path):
    """`VLLM_API_KEY` alone guards /v1 (it was served open), and the model's
    generation_config.json sampling values are the defaults, logged once at start-up."""
    from pathlib import Path

    from support.servers import ServeProcess

    model = tmp_path / "model"
    model.mkdir()
    for f in Path(tiny_model).iterdir():
        if f.name != "generation_config.json":
            (model / f.name).symlink_to(f)
    (model / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [1, 4], "temperature": 0.0, "max_new_tokens": 4}))
    env = {"VLLM_API_KEY": "vllm-key", "SHOAL_API_KEY": ""}
    s = ServeProcess(str(model), tmp_path, env=env)
    try:
        s.wait_healthy()
        assert httpx.get(f"{s.url}/v1/models").status_code == 401
        auth = {"Authorization": "Bearer vllm-key"}
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
                "ignore_eos": True}
        texts = [httpx.post(f"{s.url}/v1/chat/completions", json=body, headers=auth,
                            timeout=60).json() for _ in range(2)]
        assert all(t["usage"]["completion_tokens"] == 4 for t in texts)  # max_new_tokens
        assert texts[0]["choices"][0]["message"] == texts[1]["choices"][0]["message"]  # greedy
        log = s.log()
        assert log.count("default sampling parameters from the model's generation_config") == 1
        assert "temperature=0.0, max_tokens=4" in log and "API key: 1 accepted" in log
    finally:
        assert s.stop() == 0
