"""LoRA through the real `shoal serve` HTTP path: --enable-lora --lora-modules (both forms), a
request's `model` selects the adapter (completions and chat) and its greedy tokens equal
transformers + PEFT; /v1/models lists adapters with their parent; unknown names are 404;
VLLM_ALLOW_RUNTIME_LORA_UPDATING's load/unload endpoints with vLLM's answers; the
vllm:lora_requests_info gauge; a bad static adapter exits 2 naming it."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from support.servers import MODEL_NAME, ServeProcess

from tests.engine import lora_peft

pytestmark = pytest.mark.process
MAX_NEW = 8


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("lora-serve")
    return {"a1": lora_peft.make_adapter(tiny_model, d / "a1", 21),
            "a2": lora_peft.make_adapter(tiny_model, d / "a2", 22, r=4,
                                         targets=["q_proj", "v_proj"]),
            "big": lora_peft.make_adapter(tiny_model, d / "big", 23, r=32)}


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return torch.randint(5, 8192, (20,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.fixture(scope="module")
def server(tiny_model, adapters, tmp_path_factory):
    s = ServeProcess(tiny_model, tmp_path_factory.mktemp("serve"), "--dtype", "float32",
                     "--enable-lora", "--max-loras", "2", "--lora-modules",
                     f"a1={adapters['a1']}",
                     json.dumps({"name": "a2", "path": adapters["a2"],
                                 "base_model_name": MODEL_NAME}),
                     env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"})
    try:
        yield s.wait_healthy()
    finally:
        s.stop()


def complete(server, model: str, prompt: list[int]) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": model, "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})


def test_model_selects_the_adapter_and_equals_peft(server, tiny_model, adapters, prompt):
    for name in ("a1", "a2"):
        r = complete(server, name, prompt)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == name
        want = lora_peft.reference(tiny_model, adapters[name], [prompt], MAX_NEW)[0]
        assert body["choices"][0]["token_ids"] == want
    base = complete(server, MODEL_NAME, prompt).json()["choices"][0]["token_ids"]
    assert base == lora_peft.reference(tiny_model, None, [prompt], MAX_NEW)[0]
    assert base != complete(server, "a1", prompt).json()["choices"][0]["token_ids"]


def test_chat_selects_the_adapter(server):
    chat = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4,
            "temperature": 0}
    a = httpx.post(f"{server.url}/v1/chat/completions", json={**chat, "model": "a1"},
                   timeout=60)
    assert a.status_code == 200, a.text
    assert a.json()["model"] == "a1"


def test_models_lists_adapters_with_their_parent(server, adapters):
    cards = {c["id"]: c for c in httpx.get(f"{server.url}/v1/models").json()["data"]}
    assert cards[MODEL_NAME]["parent"] is None
    assert (cards["a1"]["parent"], cards["a1"]["root"]) == (MODEL_NAME, adapters["a1"])
    assert cards["a2"]["parent"] == MODEL_NAME


def test_unknown_model_is_404_naming_the_adapters(server, prompt):
    r = complete(server, "nope", prompt)
    assert r.status_code == 404
    assert "a1" in r.json()["error"]["message"] and MODEL_NAME in r.json()["error"]["message"]


def test_runtime_load_and_unload_as_vllm(server, adapters, prompt):
    url = server.url
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "big",
                                                        "lora_path": adapters["big"]})
    assert r.status_code == 400 and "rank 32 is greater than --max-lora-rank 16" in r.text
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x",
                                                        "lora_path": "/nonexistent/x"})
    assert r.status_code == 404 and "does not exist" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "a1",
                                                        "lora_path": adapters["a1"]})
    assert r.status_code == 400 and "has already been loaded" in r.text
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "a3"})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "Both 'lora_name' and 'lora_path' must be provided."
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "a3",
                                                        "lora_path": adapters["a2"]})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a3' added successfully."
    same = complete(server, "a3", prompt).json()["choices"][0]["token_ids"]
    assert same == complete(server, "a2", prompt).json()["choices"][0]["token_ids"]
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "a3"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a3' removed successfully."
    assert complete(server, "a3", prompt).status_code == 404
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "a3"})
    assert r.status_code == 404
    assert r.json()["error"]["message"] == "The lora adapter 'a3' cannot be found."


def test_lora_requests_info_gauge(server, prompt):
    complete(server, "a1", prompt)
    text = httpx.get(f"{server.url}/metrics").text
    lines = [x for x in text.splitlines() if x.startswith("vllm:lora_requests_info{")]
    assert len(lines) == 1 and 'max_lora="2"' in lines[0]
    assert 'running_lora_adapters=""' in lines[0]  # finished: nothing runs now
    assert float(lines[0].rsplit(" ", 1)[1]) > 1.7e9  # the time of the last update


def test_without_the_env_the_endpoints_are_not_there(tiny_model, adapters, tmp_path):
    s = ServeProcess(tiny_model, tmp_path, "--enable-lora", "--lora-modules",
                     f"a1={adapters['a1']}", env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "0"})
    try:
        s.wait_healthy()
        r = httpx.post(f"{s.url}/v1/load_lora_adapter",
                       json={"lora_name": "b", "lora_path": adapters["a2"]})
        assert r.status_code == 404
    finally:
        s.stop()


def test_a_static_adapter_that_cannot_be_applied_exits_2_naming_it(tiny_model, adapters,
                                                                    tmp_path):
    s = ServeProcess(tiny_model, tmp_path, "--enable-lora", "--lora-modules",
                     f"big={adapters['big']}")
    assert s.wait_exit(180) == 2
    assert "--lora-modules big=" in s.log() and "--max-lora-rank 16" in s.log()
