"""InprocClient: the EngineCore in this very process; every call is a plain method call and
`get_output()` means "run one step right here". For the offline LLM, tests and debugging."""

from __future__ import annotations

from typing import Any

from shoal.engine import wire
from shoal.engine.config import EngineConfig
from shoal.engine.core.sched_output import StepOutput
from shoal.engine.core_client import EngineCoreClient


class InprocClient(EngineCoreClient):
    def __init__(self, config: EngineConfig, scheduling_policy: str = "fcfs") -> None:
        from shoal.engine.core.engine_core import EngineCore

        self.engine_core = EngineCore(config, scheduling_policy=scheduling_policy)

    def add_request(self, request: wire.EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)

    def get_output(self) -> StepOutput:
        return self.engine_core.step()

    def call_utility(self, method: str, *args: Any) -> Any:
        return self.engine_core.call_utility(method, args)

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def shutdown(self) -> None:
        if self.engine_core is not None:
            self.engine_core.shutdown()
            self.engine_core = None
