"""EngineCore through its public interface: requests in, StepOutputs out, aborts, prefix
caching, utilities, and bad input that must not disturb requests already in flight."""

from __future__ import annotations

import json
import time

import pytest
import torch
from shoal.engine import wire
from shoal.engine.config import EngineConfig
from shoal.engine.core.sched_output import StepOutput

from .conftest import per_request


def request(rid: str, prompt: list[int], **params) -> wire.EngineCoreRequest:
    params.setdefault("temperature", 0.0)
    return wire.EngineCoreRequest(rid, prompt, wire.SamplingParams(**params), time.time(), 1)


def run_to_completion(core, deadline_steps: int = 500) -> dict[str, wire.EngineCoreOutput]:
    """Step until idle; return the finishing output of every request and all tokens."""
    tokens: dict[str, list[int]] = {}
    finished: dict[str, wire.EngineCoreOutput] = {}
    for _ in range(deadline_steps):
        if not core.has_unfinished_requests() and not core.scheduler.has_requests():
            return {"tokens": tokens, "finished": finished}
        for o in per_request(core.step()):
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                finished[o.request_id] = o
    raise AssertionError("engine did not go idle")


@pytest.fixture(scope="module")
def core(make_engine, tiny_model):
    return make_engine(tiny_model, max_model_len=128)


def test_step_returns_wire_outputs_with_stats(core):
    core.add_request(request("a", [10, 11, 12], max_tokens=3))
    outs = core.step()
    assert isinstance(outs, StepOutput)
    assert [o.request_id for o in outs.outputs] == ["a"]
    assert outs.scheduler_stats.num_running_reqs == 1
    assert outs.scheduler_stats.step_counter >= 1
    result = run_to_completion(core)
    assert result["finished"]["a"].finish_reason == wire.FinishReason.LENGTH
    assert core.step().outputs == []  # idle engine: empty outputs, no error


@pytest.mark.parametrize(
    "make_bad, message",
    [
        (lambda: request("bad", list(range(5, 5 + 128)), max_tokens=4), "max_model_len"),
        (lambda: request("bad", [5, 6], max_tokens=0), "max_tokens must be at least 1"),
        (lambda: request("bad", [5, 6], max_tokens=-3), "max_tokens must be at least 1"),
        (lambda: request("bad", [], max_tokens=4), "prompt is empty"),
        (lambda: request("bad", [5, 999_999], max_tokens=4), "outside the vocabulary"),
        (lambda: request("bad", [5], temperature=-1.0), "temperature"),
        (lambda: request("bad", [5], top_p=0.0), "top_p"),
        (lambda: request("bad", [5], min_tokens=5, max_tokens=2), "min_tokens"),
        (lambda: request("bad", [5], n=2), "n=1"),
    ],
)
def test_bad_request_raises_and_leaves_others_untouched(core, make_bad, message):
    core.add_request(request("good", [20, 21, 22, 23], max_tokens=6))
    core.step()
    with pytest.raises(ValueError, match=message):
        core.add_request(make_bad())
    result = run_to_completion(core)
    assert len(result["tokens"]["good"]) == 5  # one came from the first step
    assert "bad" not in result["tokens"]


def test_duplicate_request_id_is_rejected(core):
    core.add_request(request("dup", [5, 6], max_tokens=2))
    with pytest.raises(ValueError, match="unique"):
        core.add_request(request("dup", [5, 6], max_tokens=2))
    assert len(run_to_completion(core)["tokens"]["dup"]) == 2


def test_abort_mid_flight_is_idempotent_and_frees_blocks(core):
    for rid in ("x", "y", "z"):
        core.add_request(request(rid, list(range(30, 70)), max_tokens=20))
    core.step()
    core.step()
    core.abort_requests(["y"])
    core.abort_requests(["y", "never-existed"])
    core.enqueue_aborts(["z"])  # applied by the next step, after its forward pass
    core.enqueue_aborts(["z"])
    result = run_to_completion(core)
    assert result["finished"]["y"].finish_reason == wire.FinishReason.ABORT
    assert result["finished"]["z"].finish_reason == wire.FinishReason.ABORT
    assert result["finished"]["x"].finish_reason == wire.FinishReason.LENGTH
    assert len(result["tokens"]["x"]) == 18  # the two earlier steps produced the other two
    stats = core.get_kv_stats()
    assert stats["num_free_blocks"] == stats["num_usable_blocks"]


def test_prefix_cache_hits_are_counted_and_do_not_change_output(make_engine, tiny_model):
    prefix = torch.randint(5, 8192, (80,), generator=torch.Generator().manual_seed(3)).tolist()
    outputs = {}
    for caching in (False, True):
        core = make_engine(tiny_model, max_model_len=256, enable_prefix_caching=caching)
        core.add_request(request("first", prefix + [7, 8, 9], max_tokens=8))
        run_to_completion(core)
        core.add_request(request("second", prefix + [10, 11], max_tokens=8))
        hits = 0
        first_output = None
        while core.has_unfinished_requests():
            outs = core.step()
            hits += outs.scheduler_stats.prefix_cache_hits
            first_output = first_output or next(iter(outs.outputs), None)
        outputs[caching] = core
        if caching:
            assert hits == 80 and first_output.num_cached_tokens == 80  # 5 full blocks of 16
        else:
            assert hits == 0 and first_output.num_cached_tokens == 0
    # Same output with and without the cache: compare a fresh generation on each engine.
    result = {}
    for caching, core in outputs.items():
        core.add_request(request("third", prefix + [10, 11], max_tokens=8))
        result[caching] = run_to_completion(core)["tokens"]["third"]
    assert result[True] == result[False]
    assert outputs[True].reset_prefix_cache() is True
    assert outputs[True].get_kv_stats()["num_cached_blocks"] == 0


def test_utilities_are_allow_listed(core):
    assert core.call_utility("get_kv_stats", ())["num_blocks"] == core.num_blocks
    info = core.call_utility("get_engine_info", ())
    assert info["max_model_len"] == 128 and info["block_size"] == core.block_size
    with pytest.raises(ValueError, match="unknown utility"):
        core.call_utility("shutdown", ())


def test_engine_attributes_known_after_kv_sizing(make_engine, tiny_model):
    # 2 (K,V) x 4 layers x 16 tokens x 2 heads x 64 dims x 4 bytes = 64 KiB per block.
    core = make_engine(tiny_model, dtype="float32", kv_cache_memory_bytes=4 << 20,
                       max_model_len=256)
    assert core.num_blocks == 64 and core.block_size == 16 and core.max_model_len == 256


def test_kv_budget_too_small_for_one_request_says_what_to_change(tiny_model):
    from shoal.engine.core.engine_core import EngineCore

    with pytest.raises(ValueError, match="max_model_len"):
        EngineCore(EngineConfig(model=tiny_model, num_kv_blocks=4, max_model_len=512))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
        (dict(block_size=12), "power of two"),
        (dict(dtype="float8"), "dtype"),
        (dict(device="tpu"), "device"),
        (dict(max_model_len=1 << 20), "exceeds the model's context length"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
        (dict(kv_cache_memory_bytes=-1), "kv_cache_memory_bytes"),
        (dict(num_kv_blocks=1), "num_kv_blocks"),
        (dict(enable_chunked_prefill=False, max_num_batched_tokens=16), "chunked prefill"),
    ],
)
def test_config_rejects_bad_values(tiny_model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model=tiny_model, **kwargs)


def test_config_reads_kv_space_from_env(tiny_model, monkeypatch):
    monkeypatch.setenv("SHOAL_KV_CACHE_SPACE", "0.5")
    assert EngineConfig(model=tiny_model).kv_cache_memory_bytes == 1 << 29
    monkeypatch.setenv("SHOAL_KV_CACHE_SPACE", "lots")
    with pytest.raises(ValueError, match="SHOAL_KV_CACHE_SPACE"):
        EngineConfig(model=tiny_model)


@pytest.mark.parametrize("env, device, gib", [
    ({"VLLM_CPU_KVCACHE_SPACE": "2"}, "cpu", 2.0),  # a vLLM CPU manifest's budget
    ({"VLLM_CPU_KVCACHE_SPACE": "2", "SHOAL_KV_CACHE_SPACE": "0.5"}, "cpu", 0.5),  # ours first
    ({"VLLM_CPU_KVCACHE_SPACE": "0"}, "cpu", 1.0),  # vLLM's 0: not set
    ({"VLLM_CPU_KVCACHE_SPACE": ""}, "cpu", 1.0),
    ({"VLLM_CPU_KVCACHE_SPACE": "2"}, "cuda", None),  # not read for CUDA: utilization sizes
    ({"SHOAL_KV_CACHE_SPACE": "0.5"}, "cuda", 0.5),  # ours is read everywhere
    ({}, "auto", None),  # the worker sizes it once it knows the device
])
def test_config_reads_vllms_cpu_kv_space_when_no_flag_is_given(tiny_model, monkeypatch, env,
                                                                 device, gib):
    for name in ("SHOAL_KV_CACHE_SPACE", "VLLM_CPU_KVCACHE_SPACE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = EngineConfig(model=tiny_model, device=device)
    assert config.kv_cache_memory_bytes == (None if gib is None else int(gib * (1 << 30)))
    assert EngineConfig(model=tiny_model, device=device,
                        kv_cache_memory_bytes=1 << 20).kv_cache_memory_bytes == 1 << 20


def test_unknown_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        EngineConfig(model=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="no config.json"):
        EngineConfig(model=str(tmp_path))


@pytest.mark.parametrize(
    "config, message",
    [
        ({"architectures": ["BertModel"], "model_type": "bert"}, "unsupported architecture"),
        ({"model_type": "llama"}, "names no 'architectures'"),
    ],
)
def test_unsupported_architecture_is_a_clear_error(tmp_path, config, message):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        EngineConfig(model=str(tmp_path))


def test_causal_lm_without_attention_interface_is_rejected(tmp_path):
    """Mamba is a *ForCausalLM with no attention at all: nothing to plug a paged cache into."""
    from shoal.engine.worker.model_runner import ModelRunner
    from transformers import MambaConfig

    cfg = MambaConfig(hidden_size=32, num_hidden_layers=1, vocab_size=64)
    cfg.architectures = ["MambaForCausalLM"]
    cfg.save_pretrained(tmp_path)
    config = EngineConfig(model=str(tmp_path), max_model_len=64)
    runner = ModelRunner(config, torch.device("cpu"))
    with pytest.raises(ValueError, match="AttentionInterface"):
        runner.load_model()
