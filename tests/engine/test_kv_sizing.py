"""KV blocks as vLLM sizes them: the arithmetic as tables (kv_sizing.py), vLLM's profile batch,
and the profile run on the CPU with the tiny model. This machine has no GPU: the measuring on
CUDA (worker._profile_cuda_memory) runs in a session lent one; its arithmetic is tested here."""

from __future__ import annotations

import math

import pytest
import torch
from shoal.engine.config import EngineConfig
from shoal.engine.errors import ConfigError
from shoal.engine.worker.kv_sizing import (
    DeviceMemory,
    GiB,
    cpu_kv_sizing,
    cuda_kv_sizing,
    profile_schedule,
)
from shoal.engine.worker.worker import Worker

MiB = 1 << 20
H200 = 141 * GiB


@pytest.mark.parametrize("memory, util, kv_bytes, per_block, blocks", [
    # 0.9 of 141 GiB = 126.9 GiB; - 16 GiB weights - 2 GiB peak = 108.9 GiB of 2 MiB blocks
    (DeviceMemory(H200, H200 - GiB, 16 * GiB, 2 * GiB), 0.9, None, 2 * MiB,
     (math.ceil(H200 * 0.9) - 18 * GiB) // (2 * MiB)),  # ceil(total * util), as vLLM
    (DeviceMemory(80 * GiB, 80 * GiB, 16 * GiB, 4 * GiB), 0.5, None, GiB, 20),
    # other processes hold 30 GiB: the share is still of the total, and it is free
    (DeviceMemory(100 * GiB, 70 * GiB, 10 * GiB, 0), 0.7, None, GiB, 60),
    # --kv-cache-memory-bytes wins over the share (vLLM), with or without a measurement
    (DeviceMemory(80 * GiB, 80 * GiB, 16 * GiB, 4 * GiB), 0.5, 3 * GiB, GiB, 3),
    (None, 0.9, 64 * MiB, MiB, 64),
])
def test_cuda_blocks(memory, util, kv_bytes, per_block, blocks):
    sizing = cuda_kv_sizing(memory, util, kv_bytes, per_block)
    assert sizing.num_blocks == blocks
    assert ("kv_cache_memory_bytes" in sizing.source) == (kv_bytes is not None)


@pytest.mark.parametrize("memory, util, match", [
    # vLLM refuses a share that is not free at start-up
    (DeviceMemory(100 * GiB, 50 * GiB, GiB, GiB), 0.9, r"free memory on the device at start-up "
     r"\(50.00 GiB of 100.00 GiB\) is less than --gpu-memory-utilization 0.9 asks \(90.00 GiB"),
    # weights and peak leave no room: the fix is named
    (DeviceMemory(24 * GiB, 24 * GiB, 20 * GiB, 2 * GiB), 0.9, r"holds 0 blocks.*raise "
     r"--gpu-memory-utilization or lower --max-num-batched-tokens"),
])
def test_cuda_sizing_refuses_what_cannot_work(memory, util, match):
    with pytest.raises(ConfigError, match=match):
        cuda_kv_sizing(memory, util, None, GiB)


def test_cpu_blocks_are_the_byte_budget():
    assert cpu_kv_sizing(64 * MiB, MiB).num_blocks == 64
    with pytest.raises(ConfigError, match="raise --kv-cache-memory-bytes"):
        cpu_kv_sizing(MiB, MiB)


@pytest.mark.parametrize("tokens, seqs, max_len, block, lens, blocks", [
    (2048, 256, 4096, 16, [8] * 256, 257),  # vLLM: spread evenly over the seats
    (10, 4, 4096, 16, [3, 3, 2, 2], 5),
    (3, 8, 4096, 16, [1, 1, 1], 4),  # fewer tokens than seats: one token each
    (8192, 1, 2048, 16, [2048] * 4, 513),  # none longer than max_model_len (vLLM caps
    # max_num_batched_tokens by seats x max_model_len; shoal splits further instead)
    (100, 2, 16, 16, [15, 15] + [14] * 5, 8),  # more requests rather than longer ones
])
def test_profile_schedule(tokens, seqs, max_len, block, lens, blocks):
    sched, needed = profile_schedule(tokens, seqs, max_len, block)
    assert [len(t) for t in sched.token_ids] == lens
    assert needed == blocks
    assert all(sched.sample) and sched.total_num_scheduled_tokens == sum(lens)
    used = [b for table in sched.block_ids for b in table]
    assert sorted(used) == list(range(1, needed))  # block 0 stays free, none shared


def test_profile_run_on_the_cpu_leaves_nothing_behind(tiny_model):
    """The profile step itself is device-independent: here it runs on the CPU, and the runner's
    cache and requests are as before it (the CUDA meter around it is the worker's)."""
    config = EngineConfig(model=tiny_model, dtype="float32", max_num_seqs=4,
                          max_num_batched_tokens=64, kv_cache_memory_bytes=4 * MiB)
    worker = Worker(config)
    worker.init_device()
    worker.load_model()
    runner = worker.model_runner
    entered = []

    class Meter:
        def __enter__(self):
            entered.append(len(runner.kv_caches))  # the profile's cache exists by now

        def __exit__(self, *exc):
            return False

    runner.profile_run(Meter)
    assert entered == [runner.num_layers]
    assert runner.kv_caches == [] and runner.states == {}
    blocks = worker.determine_num_kv_blocks()
    assert blocks == 4 * MiB // runner.kv_bytes_per_block()
    assert worker.device == torch.device("cpu")
