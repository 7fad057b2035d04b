"""Worker: owns one device, the model runner on it, and the KV sizing from memory.

Everything the executor asks of it is a method called through `collective_rpc`, so the same
worker runs inline (UniProcExecutor) or in a child process (a multiprocess executor).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os

import torch
from shoal.engine.config import EngineConfig, cpu_kv_cache_bytes
from shoal.engine.core.sched_output import ModelRunnerOutput, SchedulerOutput
from shoal.engine.device import CudaProbe, choose_device
from shoal.engine.errors import ConfigError
from shoal.engine.worker import kv_sizing
from shoal.engine.worker.cpu.cpus import usable_cpus
from shoal.engine.worker.model_runner import ModelRunner

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    """The torch device for a config's device (`auto` chosen here, in-process, where torch is
    loaded anyway: the offline LLM; `shoal serve` passes the frontend's choice)."""
    if name == "auto":
        seen = torch.cuda.is_available()
        detail = (f"torch sees {torch.cuda.device_count()} CUDA device(s)" if seen else
                  "torch sees no CUDA device (torch.cuda.is_available() is False)")
        choice = choose_device(name, CudaProbe(seen, detail))
        log.info("%s", choice.log_line)
        name = choice.device
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} requested but torch sees no CUDA device "
                         f"(torch {torch.__version__}); use --device cpu or auto.")
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:  # torch.cuda.set_device needs an index
        device = torch.device("cuda", torch.cuda.current_device())
    return device


@dataclasses.dataclass(frozen=True)
class _CudaSnapshot:
    total: int
    free: int
    outside_torch: int  # used on the device but not reserved by torch (driver, NCCL, cuBLAS)


def _cuda_snapshot(device: torch.device) -> _CudaSnapshot:
    free, total = torch.cuda.mem_get_info(device)
    return _CudaSnapshot(total, free, total - free - torch.cuda.memory_reserved(device))


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0) -> None:
        self.config = config
        self.rank = rank
        self.device: torch.device | None = None
        self.model_runner: ModelRunner | None = None
        self._start_memory: _CudaSnapshot | None = None  # CUDA: before the weights
        self._weights_bytes = 0

    def init_device(self) -> None:
        self.device = resolve_device(self.config.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            torch.cuda.empty_cache()
            self._start_memory = _cuda_snapshot(self.device)  # vLLM's init_snapshot
        # Unset (the offline LLM): every CPU this process may use, not torch's node-wide count.
        torch.set_num_threads(self.config.num_threads or usable_cpus())
        log.info("rank %d: %d torch threads (OMP_WAIT_POLICY %s)", self.rank,
                 torch.get_num_threads(), os.environ.get("OMP_WAIT_POLICY", "unset"))
        torch.manual_seed(self.config.seed)
        self.model_runner = ModelRunner(self.config, self.device, self.rank)

    def load_model(self) -> None:
        before = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        self.model_runner.load_model()
        if self.device.type == "cuda":
            self._weights_bytes = torch.cuda.memory_allocated(self.device) - before

    def determine_num_kv_blocks(self) -> int:
        """Blocks that fit the KV budget (kv_sizing.py): the byte budget on the CPU; on CUDA
        the byte budget when given, else the share of device memory left after the weights
        and a profile run's peak."""
        per_block = self.model_runner.kv_bytes_per_block()
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.device.type == "cuda":
            kv_bytes = self.config.kv_cache_memory_bytes
            sizing = kv_sizing.cuda_kv_sizing(
                None if kv_bytes is not None else self._profile_cuda_memory(),
                self.config.gpu_memory_utilization, kv_bytes, per_block)
        else:
            sizing = kv_sizing.cpu_kv_sizing(self.config.kv_cache_memory_bytes
                                             or cpu_kv_cache_bytes(), per_block)
        log.info("rank %d: %d KV blocks of %d tokens (%d bytes each) from %s", self.rank,
                 sizing.num_blocks, self.config.block_size, per_block, sizing.source)
        return sizing.num_blocks

    def _profile_cuda_memory(self) -> kv_sizing.DeviceMemory:
        """vLLM's memory_profiling around one profile run: torch's peak allocation above what
        was allocated before it, plus what grew outside torch's allocator since start-up."""
        dev, start = self.device, self._start_memory
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        base = {}

        @contextlib.contextmanager
        def measure():
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            base["allocated"] = torch.cuda.memory_allocated(dev)
            yield
            torch.cuda.synchronize(dev)

        self.model_runner.profile_run(measure)
        torch_peak = torch.cuda.max_memory_allocated(dev) - base["allocated"]
        torch.cuda.empty_cache()
        after = _cuda_snapshot(dev)
        outside = max(0, after.outside_torch - start.outside_torch)
        memory = kv_sizing.DeviceMemory(total=start.total, free=start.free,
                                        weights=self._weights_bytes, peak=torch_peak + outside)
        log.info("rank %d: device memory %.2f GiB, %.2f GiB free at start-up; weights %.2f "
                 "GiB; profile run peak %.2f GiB (%.2f GiB outside torch)", self.rank,
                 memory.total / 2**30, memory.free / 2**30, memory.weights / 2**30,
                 memory.peak / 2**30, outside / 2**30)
        return memory

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    def add_lora(self, request) -> bool:
        return self.model_runner.add_lora(request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.model_runner.remove_lora(lora_int_id)

    def list_loras(self) -> list[int]:
        return self.model_runner.list_loras()

    def get_vocab_size(self) -> int:
        return self.model_runner.vocab_size

    def shutdown(self) -> None:
        self.model_runner = None
