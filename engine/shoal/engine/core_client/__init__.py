"""Clients of an EngineCore: "call the engine" from wherever the engine lives (vLLM V1's
core_client.py, as a package split by where the engine runs).

- inproc.py: InprocClient, the EngineCore in this very process (the offline `LLM`, tests). It
  implements EngineCoreClient (below), the synchronous contract.
- spawn.py: EngineProcess, the frontend's handle on one engine process: sockets bound, the
  process spawned (`python -m shoal.engine.core.engine_core_proc`), the start-up handshake,
  and its exit.
- mp_client.py: MPClient, what a client of an engine process needs whatever its concurrency:
  wire handles, the frames of each request, the decode of each output message.
- async_client.py: AsyncMPClient, the asyncio client AsyncLLM (the API server) drives.

Both kinds hand over a step's outputs in the one in-process shape, StepOutput
(core/sched_output.py). The errors they raise are in shoal.engine.errors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from shoal.engine import wire
from shoal.engine.core.sched_output import StepOutput


class EngineCoreClient(ABC):
    """The synchronous contract: `add_request` raises ValueError for a bad request (nothing
    else is affected); `abort_requests` is idempotent; `get_output` returns one StepOutput per
    engine step; `call_utility(method, *args)` calls an allow-listed EngineCore method by name
    (EngineCore.UTILITY_METHODS); `shutdown` is safe to call twice. AsyncMPClient offers the
    same calls as coroutines (`add_request_async`, ...)."""

    @abstractmethod
    def add_request(self, request: wire.EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self) -> StepOutput: ...

    @abstractmethod
    def call_utility(self, method: str, *args: Any) -> Any: ...

    @abstractmethod
    def shutdown(self) -> None: ...
