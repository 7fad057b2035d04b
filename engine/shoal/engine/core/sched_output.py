"""What crosses from the scheduler to the model runner each step, and back, and what a step
hands to whoever drives the EngineCore (StepOutput).

Control data only (token ids, positions, block ids): the runner owns every tensor. The structs
are plain lists so that a multiprocess executor can serialise them without torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from shoal.engine import wire


@dataclass
class NewRequestData:
    """Sent the first time a request is scheduled: what the runner keeps for sampling."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: wire.SamplingParams
    eos_token_id: int | None
    lora_request: wire.LoRARequest | None = None  # --enable-lora: the adapter it runs with


@dataclass
class SchedulerOutput:
    """One step's work. Lists are parallel, one entry per scheduled request, in batch order."""

    req_ids: list[str] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)  # tokens computed this step
    start_positions: list[int] = field(default_factory=list)  # tokens computed before
    block_ids: list[list[int]] = field(default_factory=list)  # the request's whole block table
    sample: list[bool] = field(default_factory=list)  # this step reaches the last known token
    new_requests: list[NewRequestData] = field(default_factory=list)
    finished_req_ids: set[str] = field(default_factory=set)  # runner drops their state
    preempted_req_ids: list[str] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0
    # Structured output: the constrained requests that sample this step, and their packed token
    # bitmask (int32 little-endian words, one row per id, in this order; bit set = allowed).
    grammar_req_ids: list[str] = field(default_factory=list)
    grammar_bitmask: bytes = b""

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return {r: len(t) for r, t in zip(self.req_ids, self.token_ids, strict=True)}


@dataclass
class ModelRunnerOutput:
    """The runner's answer: one sampled token per request whose `sample` flag was set."""

    sampled: dict[str, int] = field(default_factory=dict)
    # Requests with SamplingParams.logprobs: the sampled token's logprobs (one position).
    logprobs: dict[str, wire.Logprobs] = field(default_factory=dict)
    # Requests with SamplingParams.prompt_logprobs, on the step that samples their first token:
    # every prompt position after the first, gathered over the prompt's chunks.
    prompt_logprobs: dict[str, wire.Logprobs] = field(default_factory=dict)


@dataclass
class StepOutput:
    """One step's outputs: the one in-process shape, on both sides of the wire.

    The EngineCore's `step()` returns it; the engine process packs it into the wire's one shape,
    OutputBatch (codec.OutputCodec.pack), and the frontend's client unpacks that back into this
    (OutputCodec.unpack); InprocClient hands it over as it is. Plain decode tokens (one new token
    for a request that goes on: most of every step) are two parallel columns, not one
    EngineCoreOutput each, so no per-token object is built on either side. Everything else
    (first tokens, finishes, aborts) is a whole EngineCoreOutput in `outputs`. On the frontend a
    column's request id is None where the request was already dropped there (aborted): ignore
    that token. `rejected` (ADDs the engine refused) and `utility_output` (a UTILITY answer) are
    set by the engine process; `timestamp` is its time.monotonic() when it sent the step."""

    decode_req_ids: list[str | None] = field(default_factory=list)
    decode_token_ids: Sequence[int] = field(default_factory=list)
    outputs: list[wire.EngineCoreOutput] = field(default_factory=list)
    scheduler_stats: wire.SchedulerStats | None = None
    rejected: list[wire.RequestRejected] | None = None
    utility_output: wire.UtilityOutput | None = None
    timestamp: float = 0.0

    @property
    def finished_requests(self) -> list[str]:
        # A column entry never finishes its request: finishes are always whole outputs.
        return [o.request_id for o in self.outputs if o.finish_reason is not None]

    def drop(self, request_ids: set[str]) -> None:
        """Forget the outputs of these requests (aborted while the step ran)."""
        keep = [i for i, r in enumerate(self.decode_req_ids) if r not in request_ids]
        self.decode_req_ids = [self.decode_req_ids[i] for i in keep]
        self.decode_token_ids = [self.decode_token_ids[i] for i in keep]
        self.outputs = [o for o in self.outputs if o.request_id not in request_ids]
