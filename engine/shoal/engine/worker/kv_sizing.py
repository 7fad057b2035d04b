"""How many KV blocks a rank gets: pure functions of measured numbers, as vLLM sizes them.

On CUDA (vLLM's Worker.determine_available_memory, vllm/v1/worker/gpu_worker.py): the engine
may use `gpu_memory_utilization` of the device's total memory; from that share go the weights
and the peak of a profile run (one step of max_num_batched_tokens prompt tokens, activations and
memory outside torch's allocator), and the rest holds the KV cache. The device must have that
share free when the engine starts (vLLM refuses it otherwise). `kv_cache_memory_bytes` wins over
the share when given, as in vLLM. On the CPU the budget is the byte count alone
(--kv-cache-memory-bytes, else VLLM_CPU_KVCACHE_SPACE / SHOAL_KV_CACHE_SPACE, config.py).
The measuring is the worker's (worker.py); the arithmetic and the profile batch are here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shoal.engine import wire
from shoal.engine.core.sched_output import NewRequestData, SchedulerOutput
from shoal.engine.errors import ConfigError

GiB = 1 << 30


@dataclass(frozen=True)
class DeviceMemory:
    """What the worker measured on its CUDA device, in bytes."""

    total: int  # the device's memory
    free: int  # free when the engine started, before the weights
    weights: int  # what loading the weights allocated
    peak: int  # the profile run's peak above the weights (torch's peak + memory outside torch)


@dataclass(frozen=True)
class KvSizing:
    num_blocks: int
    budget: int  # bytes for the KV cache
    source: str  # how the budget was reached, for the start-up line


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def cuda_kv_sizing(memory: DeviceMemory | None, utilization: float, kv_bytes: int | None,
                   per_block: int) -> KvSizing:
    """Blocks on a CUDA device. `memory` may be None only when `kv_bytes` is given."""
    if kv_bytes is not None:
        return _blocks(kv_bytes, per_block, f"kv_cache_memory_bytes={kv_bytes} (wins over "
                       f"gpu_memory_utilization, as vLLM)")
    if memory is None:
        raise ValueError("sizing by gpu_memory_utilization needs the measured device memory")
    requested = math.ceil(memory.total * utilization)
    if memory.free < requested:
        raise ConfigError(
            f"free memory on the device at start-up ({_gib(memory.free)} of "
            f"{_gib(memory.total)}) is less than --gpu-memory-utilization {utilization} asks "
            f"({_gib(requested)}); lower it or free the device of other processes")
    budget = requested - memory.weights - memory.peak
    source = (f"gpu_memory_utilization={utilization}: {_gib(requested)} of {_gib(memory.total)}"
              f" - weights {_gib(memory.weights)} - profile peak {_gib(memory.peak)}")
    return _blocks(budget, per_block, source,
                   "raise --gpu-memory-utilization or lower --max-num-batched-tokens")


def cpu_kv_sizing(kv_bytes: int, per_block: int) -> KvSizing:
    return _blocks(kv_bytes, per_block, f"kv_cache_memory_bytes={kv_bytes} (or "
                   "VLLM_CPU_KVCACHE_SPACE / SHOAL_KV_CACHE_SPACE)")


def _blocks(budget: int, per_block: int, source: str,
            fix: str = "raise --kv-cache-memory-bytes") -> KvSizing:
    num_blocks = max(0, int(budget // per_block))
    if num_blocks < 2:
        raise ConfigError(f"the KV cache budget ({source}) holds {num_blocks} blocks of "
                          f"{per_block} bytes; at least 2 are needed: {fix}")
    return KvSizing(num_blocks, int(budget), source)


def profile_schedule(num_tokens: int, max_num_seqs: int, max_model_len: int,
                     block_size: int) -> tuple[SchedulerOutput, int]:
    """vLLM's profile batch (gpu_model_runner._dummy_run): `num_tokens` prompt tokens spread
    evenly over min(num_tokens, max_num_seqs) new requests (none longer than
    max_model_len: more requests then), each sampling one token; and the blocks it needs
    (block 0 stays free)."""
    seqs = max(1, min(num_tokens, max_num_seqs), -(-num_tokens // max_model_len))
    lens = [num_tokens // seqs + (1 if i < num_tokens % seqs else 0) for i in range(seqs)]
    sched, next_block = SchedulerOutput(), 1
    params = wire.SamplingParams(temperature=0.0, max_tokens=1)
    for i, n in enumerate(lens):
        rid = f"profile-{i}"
        blocks = -(-n // block_size)
        sched.req_ids.append(rid)
        sched.token_ids.append([0] * n)
        sched.start_positions.append(0)
        sched.block_ids.append(list(range(next_block, next_block + blocks)))
        sched.sample.append(True)
        sched.new_requests.append(NewRequestData(rid, [0] * n, params, None))
        next_block += blocks
    sched.total_num_scheduled_tokens = num_tokens
    return sched, next_block
