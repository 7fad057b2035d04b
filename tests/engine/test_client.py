"""InprocClient (the EngineCoreClient contract in-process), dtype resolution, a bfloat16 engine."""

from __future__ import annotations

import time

import pytest
import torch
from shoal.engine import wire
from shoal.engine.config import EngineConfig
from shoal.engine.core_client import EngineCoreClient
from shoal.engine.core_client.inproc import InprocClient

from .conftest import TEST_KV_BYTES, assert_no_leaks, per_request


def test_inproc_client_runs_requests_to_completion(tiny_model):
    client = InprocClient(EngineConfig(model=tiny_model, kv_cache_memory_bytes=TEST_KV_BYTES,
                                       max_model_len=256))
    assert isinstance(client, EngineCoreClient)
    params = wire.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    client.add_request(wire.EngineCoreRequest("a", [5, 6, 7], params, time.time()))
    client.add_request(wire.EngineCoreRequest("b", [8, 9], params, time.time()))
    with pytest.raises(ValueError, match="max_tokens"):
        client.add_request(wire.EngineCoreRequest(
            "c", [5], wire.SamplingParams(max_tokens=0), time.time()))
    client.abort_requests(["b"])
    tokens, finished = {}, {}
    deadline = time.monotonic() + 60
    while (client.has_unfinished_requests() or len(finished) < 2) and time.monotonic() < deadline:
        for o in per_request(client.get_output()):
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                finished[o.request_id] = o.finish_reason
    assert finished == {"a": wire.FinishReason.LENGTH, "b": wire.FinishReason.ABORT}
    assert len(tokens["a"]) == 4 and tokens["b"] == []
    assert client.call_utility("get_kv_stats")["usage"] == 0.0
    assert_no_leaks(client)
    client.shutdown()
    client.shutdown()  # safe twice


@pytest.mark.parametrize(("flag", "checkpoint", "expected"), [
    ("float32", "float32", torch.float32),
    ("bfloat16", "float32", torch.bfloat16),
    ("auto", "bfloat16", torch.bfloat16),  # a half-precision checkpoint keeps its own dtype
    ("auto", "float16", torch.float16),
    ("auto", "float32", "cpu-preferred"),  # vLLM's downcast of float32 checkpoints
    ("auto", None, "cpu-preferred"),  # no dtype in config.json: treated as float32
])
def test_auto_dtype_resolves_as_vllm_does(flag, checkpoint, expected):
    from types import SimpleNamespace

    from shoal.engine.worker.model_runner import cpu_has_native_bf16, resolve_dtype

    if expected == "cpu-preferred":
        expected = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    hf_config = SimpleNamespace(dtype=checkpoint)  # the one field read of a transformers config
    assert resolve_dtype(flag, hf_config, torch.device("cpu")) == expected


def test_default_engine_runs_in_the_resolved_dtype(make_llm, tiny_model):
    from shoal.engine.worker.model_runner import cpu_has_native_bf16

    llm = make_llm(tiny_model, max_model_len=256)
    runner = llm.engine_core.model_executor.worker.model_runner
    want = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    assert runner.dtype == want and runner.kv_caches[0][0].dtype == want
    assert next(runner.model.parameters()).dtype == want


def test_bfloat16_engine_generates(make_llm, tiny_model):
    llm = make_llm(tiny_model, dtype="bfloat16", max_model_len=256)
    k_cache = llm.engine_core.model_executor.worker.model_runner.kv_caches[0][0]
    assert k_cache.dtype == torch.bfloat16
    outs = llm.generate([[5, 6, 7], list(range(100, 160))],
                        wire.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]
    f32 = make_llm(tiny_model, dtype="float32", max_model_len=256)
    ref = f32.generate([[5, 6, 7]], wire.SamplingParams(temperature=0.0, max_tokens=1))
    # the first greedy token survives bf16
    assert outs[0].outputs[0].token_ids[0] == ref[0].outputs[0].token_ids[0]
