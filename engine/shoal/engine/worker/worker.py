"""Worker: owns one device, the model runner on it, and the KV sizing from memory.

Everything the executor asks of it is a method called through `collective_rpc`, so the same
worker runs inline (UniProcExecutor) or in a child process (a multiprocess executor).
"""

from __future__ import annotations

import logging
import os

import torch
from shoal.engine.config import EngineConfig
from shoal.engine.core.sched_output import ModelRunnerOutput, SchedulerOutput
from shoal.engine.device import CudaProbe, choose_device
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
        raise ValueError(f"device {name!r} requested but torch sees no CUDA device "
                         f"(torch {torch.__version__}); use --device cpu or auto.")
    return torch.device(name)


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0) -> None:
        self.config = config
        self.rank = rank
        self.device: torch.device | None = None
        self.model_runner: ModelRunner | None = None

    def init_device(self) -> None:
        self.device = resolve_device(self.config.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        # Unset (the offline LLM): every CPU this process may use, not torch's node-wide count.
        torch.set_num_threads(self.config.num_threads or usable_cpus())
        log.info("rank %d: %d torch threads (OMP_WAIT_POLICY %s)", self.rank,
                 torch.get_num_threads(), os.environ.get("OMP_WAIT_POLICY", "unset"))
        torch.manual_seed(self.config.seed)
        self.model_runner = ModelRunner(self.config, self.device, self.rank)

    def load_model(self) -> None:
        self.model_runner.load_model()

    def determine_num_kv_blocks(self) -> int:
        """Blocks that fit the KV budget: a byte budget on CPU, a memory fraction on CUDA."""
        per_block = self.model_runner.kv_bytes_per_block()
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - total * (1.0 - self.config.gpu_memory_utilization)
            # Leave room for activations of a full step.
            budget -= 256 * 1024 * 1024
            source = f"gpu_memory_utilization={self.config.gpu_memory_utilization}"
        else:
            budget = self.config.kv_cache_memory_bytes
            source = f"kv_cache_memory_bytes={budget} (or SHOAL_KV_CACHE_SPACE)"
        num_blocks = int(budget // per_block)
        if num_blocks < 2:
            raise ValueError(f"the KV cache budget ({source}) holds {num_blocks} blocks of "
                             f"{per_block} bytes; at least 2 are needed. Raise the budget.")
        log.info("rank %d: %d KV blocks of %d tokens (%d bytes each) from %s", self.rank,
                 num_blocks, self.config.block_size, per_block, source)
        return num_blocks

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    def get_vocab_size(self) -> int:
        return self.model_runner.vocab_size

    def shutdown(self) -> None:
        self.model_runner = None
