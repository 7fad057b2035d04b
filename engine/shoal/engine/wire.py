"""Everything that crosses the frontend <-> EngineCore process boundary.

Rules (this module is ABI):
- Every struct is `msgspec.Struct(array_like=True, omit_defaults=True, gc=False)`: a positional
  msgpack array. Field order is the wire format. New fields are only ever APPENDED, with a
  default, and with a comment saying why they exist. Never reorder, rename-in-place with a new
  meaning, or delete a field; bump PROTOCOL_VERSION when a change is not append-only.
- Enums that cross the wire are IntEnums (one msgpack byte) or byte-valued tags.
- No pickle, ever. Tensors/arrays travel as (dtype, shape, data) with data inline below a size
  threshold and as extra zero-copy frames above it (see the codec).
- This module imports neither torch nor zmq: the operator and tests use it without them.
"""

from __future__ import annotations

import enum
import time

import msgspec

# Checked in the start-up handshake; a mismatch is a clear error, never garbage.
PROTOCOL_VERSION = 1


class RequestType(bytes, enum.Enum):
    """One-byte tag frame in front of every frontend -> engine message.

    The values are the wire bytes, so there is no framing layer."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x03"
    # Engine-internal sentinels: never sent by a client.
    EXECUTOR_FAILED = b"\x04"
    WAKEUP = b"\x05"


class FinishReason(enum.IntEnum):
    """Why a request finished. IntEnum for compact serialisation."""

    STOP = 0  # EOS, a stop token id, or a stop string (frontend)
    LENGTH = 1  # max_tokens or the model's context length
    ABORT = 2  # client abort, disconnect, or shutdown in abort mode
    ERROR = 3  # the engine failed this request

    def __str__(self) -> str:  # OpenAI's finish_reason strings
        return ("stop", "length", "abort", "error")[self.value]


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Per-request sampling and stopping parameters (vLLM's names and defaults)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = []  # stop strings: detected by the frontend's detokenizer
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None = up to the context length
    min_tokens: int = 0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def verify(self) -> None:
        """Raise ValueError with a message saying what to change."""
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}."
            )
        if self.repetition_penalty <= 0.0:
            raise ValueError(
                f"repetition_penalty must be greater than 0, got {self.repetition_penalty}."
            )
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})."
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Frontend -> engine: one request, already tokenized (prompts never cross as strings)."""

    request_id: str  # unique engine-side id (the frontend's id plus a random suffix)
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float  # time.time() at the frontend, for queue-time metrics
    eos_token_id: int | None = None  # from the tokenizer the frontend owns


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Engine -> frontend: what one request produced in one step."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id that finished it, if any
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first output)


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Engine -> frontend: scheduler gauges and counters after a step (feeds /metrics)."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    prefix_cache_queries: int = 0  # tokens looked up this step
    prefix_cache_hits: int = 0  # tokens found this step
    num_preemptions: int = 0  # preemptions this step
    step_counter: int = 0  # total engine steps so far: stall detection


class UtilityOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Engine -> frontend: the answer to one UTILITY call, keyed by call_id."""

    call_id: int
    failure_message: str | None = None
    result: msgspec.Raw | None = None  # msgpack-encoded return value


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Engine -> frontend: everything one step produced, sent once per step (not per token)."""

    engine_index: int = 0
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0  # time.monotonic() in the engine process
    utility_output: UtilityOutput | None = None
    finished_requests: list[str] | None = None

    def __post_init__(self) -> None:
        if self.timestamp == 0.0:
            self.timestamp = time.monotonic()
