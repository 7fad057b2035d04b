"""Executor contract: one primitive, `collective_rpc`; everything else is a one-liner over it.

Only control data crosses an executor (SchedulerOutput down, ModelRunnerOutput up); tensors
never do. An executor owns the set of ranks and the channels to them, nothing else.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from shoal.engine.config import EngineConfig
from shoal.engine.core.sched_output import ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # Called (from any thread) with the RankFailure when a rank fails; a group only.
        self.failure_callbacks: list = []
        # Called when a headless node asks the group to shut down; a multi-node group only.
        self.on_shutdown_request = lambda request: None
        self._init_executor()

    @abstractmethod
    def _init_executor(self) -> None:
        """Start the workers: device, model loaded, ready for KV sizing."""

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple = (),
                       kwargs: dict | None = None) -> list[Any]:
        """Call `method` on every worker; return the results in rank order."""

    def determine_num_kv_blocks(self) -> int:
        return min(self.collective_rpc("determine_num_kv_blocks"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", (num_blocks,))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.collective_rpc("execute_model", (scheduler_output,))[0]

    def get_vocab_size(self) -> int:
        return self.collective_rpc("get_vocab_size")[0]

    def shutdown(self) -> None:
        self.collective_rpc("shutdown")

    def abort(self) -> None:
        """Stop at once: the engine is dying of its own error."""
        self.shutdown()
