"""UniProcExecutor: the single worker lives inline, in the EngineCore's own process."""

from __future__ import annotations

from typing import Any

from shoal.engine.executor.abstract import Executor


class UniProcExecutor(Executor):
    def _init_executor(self) -> None:
        from shoal.engine.worker.worker import Worker

        self.worker = Worker(self.config, rank=0)
        self.worker.init_device()
        self.worker.load_model()

    def collective_rpc(self, method: str, args: tuple = (),
                       kwargs: dict | None = None) -> list[Any]:
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]
