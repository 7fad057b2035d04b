"""Engine-side state of one request: what the scheduler and KV manager track per request.

A request has no prefill/decode phase: `num_computed_tokens` chases `num_tokens` (prompt plus
everything generated so far). Preemption by recompute resets `num_computed_tokens` to 0 and
keeps the generated tokens, which are recomputed with the prompt when the request resumes.
"""

from __future__ import annotations

import enum

from shoal.engine import wire


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # the engine failed this request (e.g. its grammar did not compile)

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> wire.FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: wire.FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: wire.FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: wire.FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: wire.FinishReason.ERROR,
}


class Request:
    """One request inside the engine. Owned by the scheduler; the KV manager keys on its id."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: wire.SamplingParams,
        max_tokens: int,
        eos_token_id: int | None = None,
        arrival_time: float = 0.0,
        priority: int = 0,
        lora_request: wire.LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens  # resolved: never None inside the engine
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time
        self.priority = priority  # --scheduling-policy priority: lower values are served first
        self.lora_request = lora_request  # --enable-lora: its adapter; None = the base model
        self.status = RequestStatus.WAITING
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prompt tokens served from the prefix cache; -1 = not yet
        self.num_preemptions = 0
        self.block_hashes: list[int] = []  # chained hashes of the full blocks of all_token_ids
        self.stop_reason: int | None = None
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids)
        # structured output: the StructuredOutputManager's GrammarState; None = unconstrained
        self.grammar = None
        # When it entered the engine's queue (monotonic); None once first scheduled. Kept here, not
        # in a dict beside the scheduler, so a request that ends unscheduled leaves nothing behind.
        self.queued_at: float | None = None

    @classmethod
    def from_engine_core_request(cls, req: wire.EngineCoreRequest, max_tokens: int) -> Request:
        return cls(req.request_id, req.prompt_token_ids, req.sampling_params, max_tokens,
                   req.eos_token_id, req.arrival_time, req.priority, req.lora_request)

    def __lt__(self, other: Request) -> bool:
        """The priority queue's order (vLLM's Request.__lt__): lower priority value, then earlier
        arrival, then request id."""
        return ((self.priority, self.arrival_time, self.request_id)
                < (other.priority, other.arrival_time, other.request_id))

    @property
    def use_structured_output(self) -> bool:
        return self.sampling_params.structured_outputs is not None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")
