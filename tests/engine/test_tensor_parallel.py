"""Tensor parallelism: T real processes (gloo on loopback) give the unsharded model's logits.

One spawned launcher forks four ranks; for each world size (4, then 2 on ranks 0-1) they join a
gloo group and run every model in turn through the real ModelRunner path (paged attention, KV
cache, sampling) on a fixed three-step script: full prefills, a chunked prefill with cached
context, decodes (CPU kernel and torch path), greedy and random sampling. The reference is the
same script with tensor_parallel_size 1 in this process. Models: the project's tiny/small Llama
and tiny Qwen2, and tiny random Qwen3 (per-head q/k norms, biases), Mistral, Phi-3 (fused
qkv_proj / gate_up_proj), OLMo-2 (full-width q/k norms) and Gemma-2. T=4 on 4 query / 2 KV
heads exercises KV-head replication.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import types
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from shoal.engine import wire
from shoal.engine.config import EngineConfig
from shoal.engine.core.sched_output import NewRequestData, SchedulerOutput
from shoal.engine.worker.cpu import decode_kernel as cpu_kernel
from shoal.engine.worker.cpu import fused as cpu_fused
from shoal.engine.worker.cpu import linear as cpu_linear
from shoal.engine.worker.tensor_parallel import DistributedRMSNorm
from shoal.engine.worker.worker import Worker
from support.net import free_ports

pytestmark = pytest.mark.process

# Absolute, plus a relative part for the 12-layer model whose logits reach ~35: the sharded
# sums only reorder float32 additions (measured: 1e-5 on tiny, 7e-5 on small), while a wrong
# head, slice or doubled bias moves logits by 1e-2 and more.
LOGIT_TOLERANCE = 1e-4
RELATIVE_TOLERANCE = 1e-5
BLOCK_SIZE = 8
GREEDY = wire.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SEEDED = wire.SamplingParams(temperature=1.0, seed=1234, max_tokens=8, ignore_eos=True)
UNSEEDED = wire.SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, ignore_eos=True)


def _tokens(n: int, start: int) -> list[int]:
    return [(start + 37 * i) % 500 + 5 for i in range(n)]


def script() -> list[SchedulerOutput]:
    """Three steps over four requests. Fed tokens are fixed (not the sampled ones), so sharded
    and unsharded runs see the same inputs even if a near-tie flips a sampled token."""
    a, b, c, d = _tokens(13, 1), _tokens(20, 2), _tokens(5, 3), _tokens(9, 4)
    blocks = {"a": [1, 2, 3], "b": [4, 5, 6, 7], "c": [8, 9], "d": [10, 11]}
    new = lambda rid, toks, params: NewRequestData(rid, toks, params, None)  # noqa: E731
    step1 = SchedulerOutput(
        req_ids=["a", "b", "d"], token_ids=[a, b[:12], d], start_positions=[0, 0, 0],
        block_ids=[blocks["a"], blocks["b"], blocks["d"]], sample=[True, False, True],
        new_requests=[new("a", a, GREEDY), new("b", b, GREEDY), new("d", d, UNSEEDED)])
    step2 = SchedulerOutput(  # a decode, b's second chunk over its cached context, c prefill
        req_ids=["a", "b", "c", "d"], token_ids=[[42], b[12:], c, [43]],
        start_positions=[13, 12, 0, 9], block_ids=[blocks[r] for r in "abcd"],
        sample=[True, True, True, True], new_requests=[new("c", c, SEEDED)])
    step3 = SchedulerOutput(  # all decodes
        req_ids=["a", "b", "c", "d"], token_ids=[[44], [45], [46], [47]],
        start_positions=[14, 20, 5, 10], block_ids=[blocks[r] for r in "abcd"],
        sample=[True] * 4)
    return [step1, step2, step3]


def run_script(model: str, world_size: int, rank: int, fast: bool) -> dict:
    """The script through a real Worker and ModelRunner; the logits are caught on their way to
    sampling."""
    from shoal.engine.worker import model_runner as mr

    config = EngineConfig(model=model, dtype="float32", tensor_parallel_size=world_size,
                          block_size=BLOCK_SIZE, max_model_len=64, num_kv_blocks=16,
                          kv_cache_memory_bytes=1 << 20, seed=5)
    worker = Worker(config, rank)  # the engine's path: Worker passes its rank to ModelRunner
    worker.init_device()
    # The CPU fast paths (decode kernel, oneDNN-packed linear layers, fused norms, MLPs and RoPE)
    # on or off together.
    switches = (cpu_kernel.DISABLE_ENV, cpu_linear.DISABLE_ENV, cpu_fused.DISABLE_ENV)
    previous = {name: os.environ.get(name) for name in switches}
    os.environ.update({name: "1" if fast else "0" for name in switches})
    try:
        worker.load_model()
    finally:  # this also runs in the pytest process: leave the environment as it was
        for name, value in previous.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value
    worker.initialize_kv_cache(16)
    runner = worker.model_runner
    logits, sampled = [], []
    real_sample = mr.sample

    def spy(step_logits, metadata, generator, argmax=None):
        logits.append(step_logits.clone())
        return real_sample(step_logits, metadata, generator, argmax)

    mr.sample = spy
    try:
        for step in script():
            sampled.append(worker.execute_model(step).sampled)
    finally:
        mr.sample = real_sample
    return dict(logits=logits, sampled=sampled, kv_shape=tuple(runner.kv_caches[0][0].shape),
                kv_bytes=runner.kv_bytes_per_block(), kernel=runner.cpu.decode_kernel is not None,
                packed=runner.cpu.packed_linears,
                fused=(runner.cpu.fused.norms, runner.cpu.fused.mlps,
                       cpu_fused.describe_rope(runner.cpu.fused.rope)),
                width_norms=sum(isinstance(m, DistributedRMSNorm) for m in runner.model.modules()))


def _group_main(rank: int, groups: list, out_dir: str) -> None:
    """One forked rank: for each (world size, port, jobs), largest first, join that group if this
    rank is in it and run its jobs, so one set of processes serves every world size."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    for world_size, port, jobs in groups:
        if rank >= world_size:
            return
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=120))
        try:
            for name, model, kernel in jobs:
                result = run_script(model, world_size, rank, kernel)
                torch.save(result, Path(out_dir) / f"{name}-{world_size}-{rank}.pt")
        finally:
            dist.destroy_process_group()


def _launcher(groups: list, out_dir: str) -> None:
    """Import what every rank needs, then fork the ranks (fork from this fresh, single-threaded
    process is safe; the pytest process may hold threads)."""
    import importlib

    os.setpgid(0, 0)  # its own process group: a timeout kills the launcher and its ranks at once
    for name in PRELOAD:
        importlib.import_module(name)
    torch.set_num_threads(1)
    mp.start_processes(_group_main, args=(groups, out_dir), nprocs=max(w for w, _, _ in groups),
                       join=True, start_method="fork")


# -- models ----------------------------------------------------------------------------------

def _random_model(path: Path, arch: str) -> str:
    """A tiny random model: 2 layers, 4 query / 2 KV heads of 16, every weight and bias random
    (norm weights near 1) so that a bias added twice or a misplaced head changes the logits."""
    import transformers

    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                  max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  tie_word_embeddings=False)
    cfg = {
        "qwen3": lambda: transformers.Qwen3Config(attention_bias=True, **common),
        "mistral": lambda: transformers.MistralConfig(sliding_window=None, **common),
        "phi3": lambda: transformers.Phi3Config(**common),
        "olmo2": lambda: transformers.Olmo2Config(attention_bias=True, **common),
        "gemma2": lambda: transformers.Gemma2Config(query_pre_attn_scalar=16, **common),
    }[arch]()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(path / arch)
    return str(path / arch)


RANDOM_ARCHS = ["qwen3", "mistral", "phi3", "olmo2", "gemma2"]


@pytest.fixture(scope="module")
def models(tiny_model, small_model, tiny_qwen2_model, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp-models")
    out = {"tiny": tiny_model, "small": small_model, "qwen2": tiny_qwen2_model}
    for arch in RANDOM_ARCHS:
        out[arch] = _random_model(root, arch)
    return out


# (name, model key, world sizes, CPU fast paths): the tiny models also run torch's own ops.
JOBS = [("tiny", "tiny", (2, 4), True), ("tiny-torch", "tiny", (2, 4), False),
        ("qwen2", "qwen2", (2, 4), True), ("small", "small", (2,), True)]
JOBS += [(arch, arch, (2, 4), arch != "gemma2") for arch in RANDOM_ARCHS]
WORLD_SIZES = (2, 4)
LAUNCH_TIMEOUT_S = 300
PRELOAD = ["torch.distributed", "shoal.engine.worker.model_runner", "safetensors.torch"] + [
    f"transformers.models.{m}.modeling_{m}"
    for m in ("llama", "qwen2", "qwen3", "mistral", "phi3", "olmo2", "gemma2")]


@pytest.fixture(scope="module")
def results(models, tmp_path_factory) -> dict:
    """{(job, T): [per-rank result]} from the spawned ranks, and {(job, 1): the reference}."""
    out_dir = tmp_path_factory.mktemp("tp-results")
    worlds = sorted(WORLD_SIZES, reverse=True)
    groups = [(world, port, [(name, models[key], kernel)
                             for name, key, sizes, kernel in JOBS if world in sizes])
              for world, port in zip(worlds, free_ports(len(worlds)), strict=True)]
    # One spawned launcher imports torch/transformers once and forks the ranks from it: ranks
    # spawned one by one would each import them, which dominates the run time on 2 cores.
    launcher = multiprocessing.get_context("spawn").Process(
        target=_launcher, args=(groups, str(out_dir)))
    launcher.start()
    launcher.join(timeout=LAUNCH_TIMEOUT_S)
    if launcher.is_alive():
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.join()
        pytest.fail(f"tensor-parallel ranks still running after {LAUNCH_TIMEOUT_S}s")
    assert launcher.exitcode == 0, f"a rank failed (exit code {launcher.exitcode}), see stderr"
    res = {}
    for name, key, sizes, kernel in JOBS:
        res[(name, 1)] = run_script(models[key], 1, 0, kernel)
        for world in sizes:
            res[(name, world)] = [torch.load(out_dir / f"{name}-{world}-{r}.pt")
                                  for r in range(world)]
    return res


CASES = [(name, world) for name, _, sizes, _ in JOBS for world in sizes]


@pytest.mark.parametrize(("name", "world"), CASES, ids=[f"{n}-T{w}" for n, w in CASES])
def test_sharded_logits_equal_the_unsharded_model(results, name, world):
    ref = results[(name, 1)]
    for rank, got in enumerate(results[(name, world)]):
        assert len(got["logits"]) == len(ref["logits"]) == 3
        for step, (a, b) in enumerate(zip(got["logits"], ref["logits"], strict=True)):
            assert a.shape == b.shape
            diff = (a - b).abs().max().item()
            bound = LOGIT_TOLERANCE + RELATIVE_TOLERANCE * b.abs().max().item()
            assert diff < bound, f"rank {rank} step {step}: max |diff| {diff:.2e} >= {bound:.2e}"


@pytest.mark.parametrize(("name", "world"), CASES, ids=[f"{n}-T{w}" for n, w in CASES])
def test_every_rank_computes_the_same_logits_and_samples_the_same_tokens(results, name, world):
    ranks = results[(name, world)]
    for got in ranks[1:]:
        assert got["sampled"] == ranks[0]["sampled"]  # greedy, seeded and unseeded rows alike
        for a, b in zip(got["logits"], ranks[0]["logits"], strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize(("name", "world"), CASES, ids=[f"{n}-T{w}" for n, w in CASES])
def test_greedy_tokens_match_the_unsharded_model(results, name, world):
    ref, got = results[(name, 1)], results[(name, world)][0]
    for step, (ref_tokens, tokens) in enumerate(zip(ref["sampled"], got["sampled"], strict=True)):
        for rid in ("a", "b"):
            if rid in ref_tokens:
                top2 = ref["logits"][step].topk(2, dim=-1).values
                assert tokens[rid] == ref_tokens[rid] or bool(
                    ((top2[:, 0] - top2[:, 1]) < 1e-4).any()), (step, rid)


@pytest.mark.parametrize(("name", "world"), CASES, ids=[f"{n}-T{w}" for n, w in CASES])
def test_kv_cache_holds_the_local_heads(results, models, name, world):
    """T <= KV heads splits them; T > KV heads keeps one (replicated) head per rank."""
    from transformers import AutoConfig

    key = next(k for n, k, _, _ in JOBS if n == name)
    cfg = AutoConfig.from_pretrained(models[key])
    local_kv = max(1, cfg.num_key_value_heads // world)
    ref = results[(name, 1)]
    for got in results[(name, world)]:
        assert got["kv_shape"][2] == local_kv
        assert got["kv_shape"][3] == ref["kv_shape"][3]
        assert got["kv_bytes"] * cfg.num_key_value_heads == ref["kv_bytes"] * local_kv
        assert got["kernel"] == ref["kernel"]
        # Row-parallel layers are packed like the rest: the same count as unsharded.
        assert got["packed"] == ref["packed"] and (got["packed"] > 0) == got["kernel"]
        # So are the norms, MLPs and RoPE, but the width norms that all-reduce (DistributedRMSNorm).
        assert got["fused"][0] + got["width_norms"] == ref["fused"][0], (got, ref["fused"])
        assert got["fused"][1:] == ref["fused"][1:] and (got["fused"][0] > 0) == got["kernel"]


# -- refusals (no processes needed: they happen before any communication) ----------------------

def test_a_tp_size_that_does_not_divide_the_heads_is_refused_at_start_up(tiny_model):
    from shoal.engine.worker.model_runner import ModelRunner

    config = EngineConfig(model=tiny_model, dtype="float32", tensor_parallel_size=3)
    runner = ModelRunner(config, torch.device("cpu"), rank=0)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 does not divide the 4 "
                                         r"attention heads of .*shoal-tiny.*LlamaForCausalLM"):
        runner.load_model()
    assert runner.model is None  # refused before loading any weight


@pytest.mark.parametrize(("heads", "kv", "inter", "world", "message"), [
    (12, 4, 2048, 6, "tensor_parallel_size 6 and the 4 KV heads"),
    (8, 8, 100, 8, "tensor_parallel_size 8 does not divide the MLP intermediate_size 100"),
])
def test_shapes_that_do_not_split_are_refused(heads, kv, inter, world, message):
    from shoal.engine.worker.tensor_parallel import check_shardable

    cfg = types.SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv,
                                intermediate_size=inter)
    with pytest.raises(ValueError, match=message):
        check_shardable(cfg, world, "m")


def test_a_mixture_of_experts_model_is_refused_by_name(tmp_path):
    import transformers
    from shoal.engine.worker.tensor_parallel import shard_model

    cfg = transformers.MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2,
                                     vocab_size=64, num_local_experts=2)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    before = model.model.layers[0].self_attn.q_proj.weight.shape
    with pytest.raises(ValueError, match=r"cannot shard MixtralForCausalLM.*SparseMoeBlock has "
                                         r"parameters"):
        shard_model(model, 0, 2, "MixtralForCausalLM")
    assert model.model.layers[0].self_attn.q_proj.weight.shape == before  # left intact


def test_without_torch_distributed_sharding_says_what_is_missing(tiny_model):
    from shoal.engine.worker.tensor_parallel import shard_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="needs torch.distributed initialised"):
        shard_model(model, 0, 2, "tiny")
