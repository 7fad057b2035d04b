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

The ABI rule, in full (PROTOCOL_VERSION guards it):
1. Append-only: a new field goes LAST in its struct, with a default, and a comment saying why.
2. Never reorder, delete, retype incompatibly or reuse a field; never renumber an enum member or
   a RequestType byte. A change that breaks (1) or (2) bumps PROTOCOL_VERSION.
3. Both sides announce PROTOCOL_VERSION in the start-up handshake (EngineHello / HandshakeAck);
   a mismatch stops start-up with a message naming both versions.
4. tests/serving/test_wire.py holds a fixed byte-level vector for a decode batch: a reorder of the
   hot-path fields fails it.

What travels where (see docs/serving.md for the diagram):
- frontend -> engine, on the engine's DEALER (frontend ROUTER): [identity][RequestType][msgpack]
  with EngineCoreRequest (ADD), list[str] (ABORT), UtilityCall (UTILITY), HandshakeAck.
- engine -> frontend, on the same socket, first thing at start-up: EngineHello.
- engine -> frontend, on PUSH (frontend PULL): OutputBatch (a step's outputs, columnar; the
  codec converts it from and to StepOutput, their one in-process shape) plus zero-copy aux
  frames; or a two-frame notice, told apart by its first frame, one of the constants below:
  [ENGINE_CORE_READY][EngineReady], [ENGINE_CORE_DEAD][EngineDead],
  [ENGINE_CORE_STOPPED][EngineStopped].
"""

from __future__ import annotations

import enum

import msgspec

# Checked in the start-up handshake; a mismatch is a clear error, never garbage.
PROTOCOL_VERSION = 1


class RequestType(bytes, enum.Enum):
    """One-byte tag frame in front of every frontend -> engine message.

    The values are the wire bytes, so there is no framing layer."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x03"
    # Engine-internal sentinel (a rank or an IO thread failed): never sent by a client.
    EXECUTOR_FAILED = b"\x04"
    # b"\x05" was WAKEUP, an engine-internal sentinel nothing sent: never reuse it.
    # Frontend -> engine answer to EngineHello (a HandshakeAck): protocol check on both sides.
    HANDSHAKE = b"\x06"


class FinishReason(enum.IntEnum):
    """Why a request finished. IntEnum for compact serialisation."""

    STOP = 0  # EOS, a stop token id, or a stop string (frontend)
    LENGTH = 1  # max_tokens or the model's context length
    ABORT = 2  # client abort, disconnect, or shutdown in abort mode
    ERROR = 3  # the engine failed this request

    def __str__(self) -> str:  # OpenAI's finish_reason strings
        return ("stop", "length", "abort", "error")[self.value]


class StructuredOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A constraint on a request's output (vLLM's StructuredOutputsParams, one kind at a time):
    the EngineCore compiles it into a grammar and masks the logits of every step with it."""

    # "json" (a JSON schema), "regex", "choice" (a JSON list of strings), "grammar" (Lark)
    kind: str
    spec: str  # the schema's JSON text, the regex, the JSON list, or the Lark grammar


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
    # Structured output (response_format, guided_*, tool calls): None = unconstrained.
    structured_outputs: StructuredOutputs | None = None
    # vLLM's prompt_logprobs: the logprob, rank and top-N alternatives of every prompt token
    # after the first (N = this value, 0 = the prompt token alone); None = not asked.
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        """vLLM's offline forms: one stop string (`stop="Question:"` is that string, not its
        characters) and None for either stop list."""
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop_token_ids is None:
            self.stop_token_ids = []

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
        for name in ("logprobs", "prompt_logprobs"):  # the upper bound: --max-logprobs
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be non-negative, got {value}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class LoRARequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A LoRA adapter a request runs with (vLLM's LoRARequest: name, a positive integer id
    unique per adapter, the PEFT directory). The engine keys its prefix cache by (name, id), so
    an adapter loaded again under a new id never reuses the old one's blocks."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None  # what /v1/models names as its parent


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Frontend -> engine: one request, already tokenized (prompts never cross as strings)."""

    request_id: str  # unique engine-side id (the frontend's id plus a random suffix)
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float  # time.time() at the frontend, for queue-time metrics
    eos_token_id: int | None = None  # from the tokenizer the frontend owns
    # Small integer the frontend's client assigns at ADD time; outputs on the wire name the
    # request by this handle instead of the ~34-byte id (the columnar OutputBatch). Unique among
    # live requests of one client; None when the request never crosses a process boundary.
    wire_handle: int | None = None
    # vLLM's request `priority` (--scheduling-policy priority: lower values are scheduled first
    # and preempted last); 0 under fcfs, where the frontend refuses any other value.
    priority: int = 0
    # The LoRA adapter this request runs with (--enable-lora); None = the base model.
    lora_request: LoRARequest | None = None


class Logprobs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Logprobs of consecutive positions of one request, as packed little-endian columns.

    Per position: the chosen token (the sampled one, or the prompt's next token) first, then the
    `num_top` most likely tokens by rank. Values are log_softmax of the raw logits (vLLM's
    default logprobs_mode, raw_logprobs: before penalties, temperature and top-k/p)."""

    num_top: int  # alternatives per position (the request's N)
    token_ids: bytes = b""  # int32, (1 + num_top) per position
    logprobs: bytes = b""  # float32, parallel to token_ids
    ranks: bytes = b""  # int32, one per position: the chosen token's rank (1 = most likely)


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Engine -> frontend: what one request produced in one step."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id that finished it, if any
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first output)
    # SamplingParams.logprobs was set: the logprobs of new_token_ids, one position per token.
    new_logprobs: Logprobs | None = None
    # SamplingParams.prompt_logprobs was set: prompt positions 1..P-1, with the first token.
    new_prompt_logprobs: Logprobs | None = None


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Engine -> frontend: scheduler gauges and counters after a step (feeds /metrics)."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    prefix_cache_queries: int = 0  # tokens looked up this step
    prefix_cache_hits: int = 0  # tokens found this step
    num_preemptions: int = 0  # preemptions this step
    step_counter: int = 0  # total engine steps so far: stall detection
    # Requests scheduled for the first time this step, each [engine request id, seconds it
    # waited in the engine's queue] on the engine's clock: vLLM's request_queue_time_seconds,
    # and the start of prefill for request_prefill_time_seconds.
    first_scheduled: list[tuple[str, float]] | None = None
    # --enable-lora: adapter name -> requests running / waiting with it (vLLM's SchedulerStats
    # fields, feeding vllm:lora_requests_info); None without LoRA.
    running_lora_adapters: dict[str, int] | None = None
    waiting_lora_adapters: dict[str, int] | None = None


class UtilityOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Engine -> frontend: the answer to one UTILITY call, keyed by call_id."""

    call_id: int
    failure_message: str | None = None
    result: bytes | None = None  # the return value, msgpack-encoded (decode with its own type)


class RequestRejected(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Engine -> frontend: an ADD the engine did not admit, and why (HTTP-shaped status)."""

    request_id: str
    status: int  # 400 = the request is invalid, 503 = the engine is draining / shutting down
    message: str


# ----- start-up handshake ------------------------------------------------------------------


class EngineHello(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="hello"):
    """Engine -> frontend, first message on the input socket, sent before any heavy work, so a
    protocol mismatch fails in milliseconds instead of after loading weights."""

    protocol_version: int
    engine_version: str
    pid: int
    hostname: str
    engine_index: int = 0
    rank: int = 0


class HandshakeAck(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Frontend -> engine (RequestType.HANDSHAKE): the frontend's own versions and whether it
    accepts this engine; the engine checks the version too and exits with the reason if not."""

    protocol_version: int
    engine_version: str
    accepted: bool = True
    reason: str = ""


class EngineReady(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="ready"):
    """Engine -> frontend after weights are loaded and the KV cache is sized. max_model_len and
    num_blocks are only known now; the frontend validates prompt lengths against these."""

    protocol_version: int
    engine_version: str
    max_model_len: int
    num_blocks: int
    block_size: int
    dtype: str
    max_num_seqs: int
    max_num_batched_tokens: int
    model: str = ""
    vocab_size: int = 0
    tensor_parallel_size: int = 1
    world_size: int = 1
    enable_prefix_caching: bool = False
    startup_seconds: float = 0.0  # engine-side time from process start to ready



# ----- control plane ------------------------------------------------------------------------


class UtilityCall(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Frontend -> engine (RequestType.UTILITY): call one allow-listed EngineCore method.
    The answer comes back as OutputBatch.utility_output with the same call_id."""

    call_id: int
    method: str
    args: list = []


# ----- columnar output batch ----------------------------------------------------------------


class OutputBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Engine -> frontend: one step's outputs, the wire's one shape for them (codec.py packs a
    StepOutput into it and unpacks it back).

    Plain decode outputs (one new token, nothing else set) travel as two packed little-endian
    columns, `handles` and `token_ids`, of `handle_width` / `token_width` bytes per entry (2 or 4),
    so a generated token costs 4-8 bytes instead of ~41. Every other output (a finish, several
    tokens, cached-token counts, any field appended later) travels whole in `extras` with an
    empty request_id, its handle in the parallel `extra_handles` list."""

    engine_index: int = 0
    handle_width: int = 4
    token_width: int = 4
    handles: bytes = b""
    token_ids: bytes = b""
    extras: list[EngineCoreOutput] = []
    extra_handles: list[int] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    utility_output: UtilityOutput | None = None
    finished_requests: list[str] | None = None
    rejected: list[RequestRejected] | None = None


# ----- death and clean exit -----------------------------------------------------------------

# First frame of the two-frame notices on the output socket (a msgpack batch never starts so).
ENGINE_CORE_READY = b"ENGINE_CORE_READY"
ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"
ENGINE_CORE_STOPPED = b"ENGINE_CORE_STOPPED"


class EngineDead(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Engine -> frontend: the engine is dying, and the root cause, so the frontend can name it
    in every HTTP error and in the termination message instead of "see logs above"."""

    process: str  # e.g. "EngineCore_0"
    pid: int
    rank: int
    exc_type: str  # exception class name, e.g. "RuntimeError"
    message: str
    traceback: str = ""
    hostname: str = ""
    # Multi-node groups: the node the failing process ran on (0 = the EngineCore's node).
    node_rank: int = 0
    # The termination cause (shoal.contract.termination.Cause value) decided by the process that
    # held the exception (core/engine_core_proc/death.py); "" from a peer that predates it.
    cause: str = ""

    def describe(self) -> str:
        node = f", node {self.node_rank}" if self.node_rank else ""
        return (f"{self.process} (pid {self.pid}, rank {self.rank}{node}) died: "
                f"{self.exc_type}: {self.message}")


class EngineStopped(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Engine -> frontend: a clean, requested exit (SIGTERM drain/abort finished)."""

    pid: int
    mode: str  # "drain" or "abort"
    num_aborted: int = 0
