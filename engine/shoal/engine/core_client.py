"""EngineCoreClient: "call the engine" looks the same wherever the engine lives.

Subclasses:
- InprocClient (here): the EngineCore runs in this process; `get_output()` means "run one step
  right here". For the offline LLM, tests and debugging.
- SyncMPClient / AsyncMPClient (shoal.engine.mp_client): the EngineCore runs in a child
  process reached over ZMQ sockets with the structs of shoal.engine.wire.

Contract: `add_request` raises ValueError for a bad request (nothing else is affected);
`abort_requests` is idempotent; `get_output` returns one EngineCoreOutputs per engine step;
`call_utility(method, *args)` calls an allow-listed EngineCore method by name
(EngineCore.UTILITY_METHODS); `shutdown` is safe to call twice.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from shoal.engine import wire
from shoal.engine.config import EngineConfig


class EngineCoreClient(ABC):
    @abstractmethod
    def add_request(self, request: wire.EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self) -> wire.EngineCoreOutputs: ...

    @abstractmethod
    def call_utility(self, method: str, *args: Any) -> Any: ...

    @abstractmethod
    def shutdown(self) -> None: ...


class InprocClient(EngineCoreClient):
    """The EngineCore in this very process: every call is a plain method call."""

    def __init__(self, config: EngineConfig) -> None:
        from shoal.engine.core.engine_core import EngineCore

        self.engine_core = EngineCore(config)

    def add_request(self, request: wire.EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)

    def get_output(self) -> wire.EngineCoreOutputs:
        return self.engine_core.step()

    def call_utility(self, method: str, *args: Any) -> Any:
        return self.engine_core.call_utility(method, args)

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def shutdown(self) -> None:
        if self.engine_core is not None:
            self.engine_core.shutdown()
            self.engine_core = None
