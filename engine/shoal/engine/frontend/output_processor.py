"""OutputProcessor: a step's outputs (StepOutput) -> per-request RequestOutputs in one-slot
collectors.

Every request exists twice: here (RequestState) and in the engine's scheduler. This side owns
the text: incremental detokenization and stop strings are done here, and a stop string turns
into an abort the caller sends to the engine. Removal here is authoritative; the engine's copy
dies when the abort arrives.

RequestOutputCollector is a mailbox with ONE slot: when the consumer (an HTTP stream) is slower
than the engine, new output is merged into the waiting one, so chunks grow but no token is ever
dropped or duplicated.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from shoal.engine.frontend.logprobs import PositionLogprobs, TokenStrings, unpack
from shoal.engine.wire import EngineCoreOutput, FinishReason, SamplingParams
from tokenizers.decoders import DecodeStream


@dataclass
class RequestOutput:
    """What a consumer gets: the text and tokens produced since its last get (a delta)."""

    request_id: str  # the caller's id
    text: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_output_tokens: int  # cumulative
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # SamplingParams.logprobs set: one entry per token of token_ids.
    logprobs: list[PositionLogprobs] | None = None
    # SamplingParams.prompt_logprobs set: once, with the first token; entry 0 is None.
    prompt_logprobs: list[PositionLogprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def merge(self, newer: RequestOutput) -> None:
        self.text += newer.text
        self.token_ids.extend(newer.token_ids)
        if newer.logprobs is not None:
            self.logprobs = (self.logprobs or []) + newer.logprobs
        if newer.prompt_logprobs is not None:
            self.prompt_logprobs = newer.prompt_logprobs
        self.num_output_tokens = newer.num_output_tokens
        self.num_cached_tokens = max(self.num_cached_tokens, newer.num_cached_tokens)
        self.finish_reason = newer.finish_reason
        self.stop_reason = newer.stop_reason


class RequestOutputCollector:
    """One-slot mailbox between the output handler (producer) and one request's consumer."""

    def __init__(self) -> None:
        self.output: RequestOutput | BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        if self.output is None or isinstance(item, BaseException):
            self.output = item
        elif isinstance(self.output, RequestOutput):
            self.output.merge(item)  # merge, never drop
        self.ready.set()

    async def get(self) -> RequestOutput:
        while self.output is None:
            await self.ready.wait()
        return self._take()

    def get_nowait(self) -> RequestOutput | None:
        return None if self.output is None else self._take()

    def _take(self) -> RequestOutput:
        out, self.output = self.output, None
        self.ready.clear()
        if isinstance(out, BaseException):
            raise out
        return out


class IncrementalDetokenizer:
    """Text for a growing token list, plus stop-string detection with a hold-back buffer (text
    that might be the start of a stop string is not released until it is known not to be)."""

    def __init__(self, tokenizer, params: SamplingParams) -> None:
        self._tokenizer = tokenizer.backend_tokenizer
        self._stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self.stop = [s for s in params.stop if s]
        self.include_stop = params.include_stop_str_in_output
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.sent = 0  # chars of `text` already released

    def append(self, token_ids: list[int]) -> str | None:
        """Add tokens; return the stop string if one completed (the text is then cut there)."""
        old_len = len(self.text)
        for t in token_ids:
            piece = self._stream.step(self._tokenizer, t)
            if piece:
                self.text += piece
        if not self.stop or len(self.text) == old_len:
            return None
        start = max(0, old_len - self.holdback)
        best = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[: i + len(s) if self.include_stop else i]
        return s

    def release(self, finished: bool) -> str:
        upto = len(self.text) if finished else max(self.sent, len(self.text) - self.holdback)
        delta, self.sent = self.text[self.sent:upto], upto
        return delta


@dataclass
class RequestState:
    external_id: str
    engine_id: str
    prompt_len: int
    params: SamplingParams
    detok: IncrementalDetokenizer
    collector: RequestOutputCollector
    arrival: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    itls: list[float] = field(default_factory=list)
    queue_time: float | None = None  # seconds in the engine's queue (SchedulerStats)


class OutputProcessor:
    def __init__(self, tokenizer, metrics=None) -> None:
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.request_states: dict[str, RequestState] = {}
        self.token_string = TokenStrings(tokenizer)
        # Tokens of the step being processed (vLLM's IterationStats): a request's prompt counts
        # when its first token arrives; read and reset by take_step_tokens().
        self.step_prompt_tokens = 0
        self.step_generation_tokens = 0

    def take_step_tokens(self) -> tuple[int, int]:
        counts = (self.step_prompt_tokens, self.step_generation_tokens)
        self.step_prompt_tokens = self.step_generation_tokens = 0
        return counts

    def record_first_scheduled(self, waited: list[tuple[str, float]] | None) -> None:
        """The engine scheduled these requests for the first time, after `seconds` queued."""
        for engine_id, seconds in waited or ():
            state = self.request_states.get(engine_id)
            if state is not None:
                state.queue_time = seconds

    def add_request(self, engine_id: str, external_id: str, prompt_len: int,
                    params: SamplingParams) -> RequestOutputCollector:
        collector = RequestOutputCollector()
        self.request_states[engine_id] = RequestState(
            external_id, engine_id, prompt_len, params,
            IncrementalDetokenizer(self.tokenizer, params), collector)
        return collector

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> list[str]:
        """Feed one step's outputs; returns engine ids to abort in the engine (stop strings)."""
        to_abort: list[str] = []
        now = time.monotonic()
        get = self.request_states.get
        for o in outputs:
            state = get(o.request_id)
            if state is not None:  # else: already finished or aborted here
                self._process(state, o.new_token_ids, o.finish_reason, o.stop_reason,
                              o.num_cached_tokens, now, to_abort, o)
        return to_abort

    def process_tokens(self, request_ids, token_ids) -> list[str]:
        """The columnar fast path: one plain decode token per request (None ids: ignored)."""
        to_abort: list[str] = []
        now = time.monotonic()
        get = self.request_states.get
        for rid, t in zip(request_ids, token_ids, strict=True):
            state = get(rid) if rid is not None else None
            if state is not None:
                self._process(state, [t], None, None, 0, now, to_abort)
        return to_abort

    def _process(self, state: RequestState, new_token_ids: list[int], finish, stop_reason,
                 num_cached_tokens: int, now: float, to_abort: list[str],
                 whole: EngineCoreOutput | None = None) -> None:
        n_new = len(new_token_ids)
        if n_new:
            if state.first_token_time is None:
                state.first_token_time = now
                state.num_cached_tokens = num_cached_tokens
                self.step_prompt_tokens += state.prompt_len
            else:
                state.itls.append(now - state.last_token_time)
            state.last_token_time = now
            state.num_output_tokens += n_new
            self.step_generation_tokens += n_new
        stop_str = state.detok.append(new_token_ids) if n_new else None
        if stop_str is not None:
            if finish is None:
                to_abort.append(state.engine_id)
            finish, stop_reason = FinishReason.STOP, stop_str
        finished = finish is not None
        out = RequestOutput(
            request_id=state.external_id,
            text=state.detok.release(finished),
            token_ids=list(new_token_ids),
            num_prompt_tokens=state.prompt_len,
            num_output_tokens=state.num_output_tokens,
            num_cached_tokens=state.num_cached_tokens,
            finish_reason=str(finish) if finished else None,
            stop_reason=stop_reason,
        )
        if state.params.logprobs is not None:
            out.logprobs = self._logprobs(whole, new_token_ids)
        if whole is not None and whole.new_prompt_logprobs is not None:
            out.prompt_logprobs = [None, *unpack(whole.new_prompt_logprobs, self.token_string)]
        state.collector.put(out)
        if finished:
            del self.request_states[state.engine_id]
            if self.metrics is not None:
                self.metrics.record_finished(state, str(finish), now)

    def _logprobs(self, whole: EngineCoreOutput | None, new_token_ids: list[int]
                  ) -> list[PositionLogprobs]:
        lp = None if whole is None else whole.new_logprobs
        positions = [] if lp is None else unpack(lp, self.token_string)
        if len(positions) != len(new_token_ids):  # the engine broke its contract: say so
            raise RuntimeError(f"the engine sent logprobs for {len(positions)} of "
                               f"{len(new_token_ids)} new tokens")
        return positions

    def abort_request(self, engine_id: str) -> bool:
        """Retire a request here (client gone); its consumer, if any, sees finish 'abort'."""
        state = self.request_states.pop(engine_id, None)
        if state is None:
            return False
        state.collector.put(RequestOutput(
            state.external_id, state.detok.release(True), [], state.prompt_len,
            state.num_output_tokens, state.num_cached_tokens, finish_reason="abort"))
        if self.metrics is not None:
            self.metrics.record_finished(state, "abort", time.monotonic())
        return True

    def fail_request(self, engine_id: str, error: BaseException) -> None:
        state = self.request_states.pop(engine_id, None)
        if state is not None:
            state.collector.put(error)

    def propagate_error(self, error: BaseException) -> None:
        """The engine is gone: every in-flight request ends with this error."""
        for state in self.request_states.values():
            state.collector.put(error)
        self.request_states.clear()
