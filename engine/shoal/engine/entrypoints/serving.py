"""Plumbing shared by the generation endpoints: fan a request out into one engine request per
choice, collect or stream the choices, and stop when the client leaves.

`Serving` lives in the API server process, one per app; the endpoint groups
(serving_completions.py, serving_chat.py, serving_admin.py) hold only their request shapes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry
from shoal.engine.entrypoints.http_errors import error_json
from shoal.engine.errors import UnknownModelError
from shoal.engine.frontend.async_llm import AsyncLLM
from shoal.engine.frontend.logprobs import PositionLogprobs
from shoal.engine.frontend.output_processor import RequestOutput
from shoal.engine.lora.config import LoRARegistry
from shoal.engine.wire import LoRARequest, SamplingParams

logger = logging.getLogger("shoal.engine.api")
_json = msgspec.json.Encoder()
PRIORITY_HEADER = "X-Vllm-Priority"  # vLLM's: a request's priority, over the body's


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI's usage; with `cached_tokens` (--enable-prompt-tokens-details) vLLM's
    prompt_tokens_details: the prompt tokens served from the prefix cache."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def sse(obj) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


async def merged_choices(gens: list[AsyncIterator[RequestOutput]]
                         ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, delta) from several generators as they come; closes all on exit."""
    if len(gens) == 1:
        async with contextlib.aclosing(gens[0]) as g:
            async for out in g:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async with contextlib.aclosing(gen) as g:
                async for out in g:
                    queue.put_nowait((i, out))
        except BaseException as exc:  # noqa: BLE001 - re-raised by the consumer
            queue.put_nowait((i, exc))
            return
        queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def until_disconnect(request: Request, coro):
    """Run `coro`; if the client disconnects first, cancel it (its requests are aborted)."""
    task = asyncio.ensure_future(coro)

    async def watch() -> None:
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None
    return task.result()


@dataclass
class Collected:
    """Every choice of a non-streaming request, gathered."""

    texts: list[str]
    finish: list[str | None]
    stop_reason: list
    completion_tokens: list[int]
    token_ids: list[list[int]]
    # Per choice, when the request asked for them (else None).
    logprobs: list[list[PositionLogprobs] | None] = field(default_factory=list)
    prompt_logprobs: list[list[PositionLogprobs | None] | None] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)  # prompt tokens from the prefix cache

    def usage(self, n_prompt: list[int], details: bool) -> dict:
        """The answer's usage; with `details`, the first choice's cached prompt tokens (vLLM
        reports its one request's)."""
        return usage(sum(n_prompt), sum(self.completion_tokens),
                     self.cached[0] if details else None)


async def collect(gens) -> Collected:
    c = Collected([""] * len(gens), [None] * len(gens), [None] * len(gens), [0] * len(gens),
                  [[] for _ in gens], [None] * len(gens), [None] * len(gens), [0] * len(gens))
    async for i, out in merged_choices(gens):
        c.cached[i] = max(c.cached[i], out.num_cached_tokens)
        c.texts[i] += out.text
        c.token_ids[i] += out.token_ids
        if out.logprobs is not None:
            c.logprobs[i] = (c.logprobs[i] or []) + out.logprobs
        if out.prompt_logprobs is not None:
            c.prompt_logprobs[i] = out.prompt_logprobs
        c.completion_tokens[i] = out.num_output_tokens
        if out.finished:
            c.finish[i], c.stop_reason[i] = out.finish_reason, out.stop_reason
    return c


@dataclass(frozen=True)
class OutputSettings:
    """vLLM's server-wide flags on the shape of answers (serve.py fills them from the flags)."""

    # --return-tokens-as-token-ids: logprob tokens as "token_id:{id}" (a request's own
    # return_tokens_as_token_ids wins, as in vLLM).
    return_tokens_as_token_ids: bool = False
    # --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens.
    enable_prompt_tokens_details: bool = False

    @classmethod
    def from_args(cls, args) -> OutputSettings:
        return cls(args.return_tokens_as_token_ids, args.enable_prompt_tokens_details)


@dataclass
class Serving:
    """What every endpoint group needs: the engine client and the names it serves under."""

    llm: AsyncLLM
    served_model_names: list[str]
    # The model's generation_config sampling values (generation_config.py): a request's
    # defaults, below its own values.
    sampling_defaults: dict = field(default_factory=dict)
    # The generation endpoints by body type ("chat", "completion"), for /invocations.
    endpoints: dict = field(default_factory=dict)
    output: OutputSettings = field(default_factory=OutputSettings)
    # vLLM's HTTP request metrics (http_metrics.py): rendered by /metrics after the engine's.
    http_metrics: CollectorRegistry | None = None
    # --enable-lora: the adapters served by name (lora/config.py); None without LoRA.
    loras: LoRARegistry | None = None

    def prompt_details(self, request: Request) -> bool:
        """Whether usage carries prompt_tokens_details: the flag, or an endpoint that always
        reports them (/v1/responses' input_tokens_details, as vLLM's)."""
        return (self.output.enable_prompt_tokens_details
                or getattr(request.state, "prompt_tokens_details", False))

    def tokens_as_ids(self, body) -> bool:
        """Whether logprob tokens are "token_id:{id}": the request's field, else the flag."""
        if body.return_tokens_as_token_ids is not None:
            return body.return_tokens_as_token_ids
        return self.output.return_tokens_as_token_ids

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, name: str | None) -> LoRARequest | None:
        """The request's `model`: a served name (None: the base model) or, with --enable-lora,
        an adapter's name (its LoRARequest); anything else is OpenAI's 404 naming what is
        served."""
        if name is None or name in self.served_model_names:
            return None
        lora = self.loras.get(name) if self.loras is not None else None
        if lora is None:
            served = self.served_model_names + (list(self.loras.adapters) if self.loras else [])
            raise UnknownModelError(f"The model `{name}` does not exist. Served models: "
                                    f"{served}.")
        return lora

    def response_model(self, lora: LoRARequest | None) -> str:
        """The `model` an answer names: the adapter's name for an adapter request (vLLM's)."""
        return self.model_name if lora is None else lora.lora_name

    def ensure_available(self) -> None:
        self.llm._check_available()

    @staticmethod
    def request_id(request: Request, body, prefix: str) -> str:
        """vLLM's response id: `prefix` + the X-Request-Id header, else the body's request_id,
        else a random one (the engine's ids add a suffix, so reused ids stay distinct)."""
        given = request.headers.get("X-Request-Id") or body.request_id
        return f"{prefix}{given if given is not None else uuid.uuid4().hex}"

    @staticmethod
    def priority(request: Request, body) -> int:
        """vLLM's: the X-Vllm-Priority header when it is an integer, else the body's priority."""
        header = request.headers.get(PRIORITY_HEADER)
        if header is not None:
            try:
                return int(header)
            except ValueError:
                pass
        return body.priority

    def prompt_of(self, body, ids: list[int]) -> list[int]:
        """The prompt after the body's truncate_prompt_tokens (vLLM's semantics and errors)."""
        return body.truncated(ids, self.llm.input_processor.max_model_len)

    def start_choices(self, prompts: list[list[int]], params: SamplingParams, n: int,
                      request_id: str, priority: int = 0,
                      lora: LoRARequest | None = None) -> list[AsyncIterator[RequestOutput]]:
        """One engine request per (prompt, choice); seeds step by choice, as vLLM's do.
        `lora`: the adapter every choice runs with (None: the base model)."""
        per_choice = []
        for ids in prompts:
            for j in range(n):
                p = msgspec.structs.replace(params, seed=None if params.seed is None
                                            else params.seed + j)
                # Validate now, so a bad request is a 400 before any stream starts.
                self.llm.input_processor.process("validate", ids, msgspec.structs.replace(p),
                                                 priority)
                per_choice.append((ids, p))
        for _ in prompts:  # vLLM's request_params_n: once per prompt (its parent request)
            self.llm.metrics.record_params_n(n)
        return [self.llm.generate(ids, p, f"{request_id}-{i}", priority, lora)
                for i, (ids, p) in enumerate(per_choice)]

    async def respond(self, request: Request, gens, n_prompt: list[int], head: dict,
                      choice_body, prompt_ids: list[list[int]] | None = None,
                      add_logprobs: Callable[[dict, Collected], None] | None = None
                      ) -> Response:
        """The non-streaming answer: every choice collected, its body `choice_body(text)`; 499 if
        the client left first (its requests are aborted). With `prompt_ids` (vLLM's
        return_token_ids) each choice also carries its prompt's and its own token ids.
        `add_logprobs(response, collected)` fills the endpoint's logprob fields in place."""
        c = await until_disconnect(request, collect(gens))
        if c is None:
            return Response(status_code=499)
        choices = [{"index": i, **choice_body(c.texts[i]), "logprobs": None,
                    "finish_reason": c.finish[i], "stop_reason": c.stop_reason[i]}
                   for i in range(len(gens))]
        if prompt_ids is not None:
            for i, choice in enumerate(choices):
                choice["prompt_token_ids"], choice["token_ids"] = prompt_ids[i], c.token_ids[i]
        response = {**head, "choices": choices,
                    "usage": c.usage(n_prompt, self.prompt_details(request))}
        if add_logprobs is not None:
            add_logprobs(response, c)
        return JSONResponse(response)

    async def stream_events(self, gens, make_chunk, n_prompt: list[int],
                            usage_flags: tuple[bool, bool],
                            first_chunks: list[dict], details: bool = False
                            ) -> AsyncIterator[bytes]:
        """SSE bytes: `first_chunks` (one per choice, in order), one chunk per delta with text or
        a finish, the usage chunk if asked, and `data: [DONE]`; a failure after the 200 is
        reported in-band. `usage_flags`: (final usage chunk, usage in every chunk: vLLM's
        continuous_usage_stats, the choice's prompt and its tokens so far); `details`: the
        final usage carries prompt_tokens_details (the first choice's cached tokens)."""
        include_usage, continuous = usage_flags
        completion = [0] * len(gens)
        cached = [0] * len(gens)

        def framed(i: int, obj: dict) -> bytes:
            if continuous:
                obj["usage"] = usage(n_prompt[i], completion[i])
            return sse(obj)

        try:
            for i, c in enumerate(first_chunks):
                yield framed(i, c)
            async for i, out in merged_choices(gens):
                completion[i] = out.num_output_tokens
                cached[i] = max(cached[i], out.num_cached_tokens)
                if out.text or out.finished or out.logprobs:  # logprobs: even without text
                    obj = make_chunk(i, out)
                    if obj is not None:  # None: nothing to send (a lone reasoning token)
                        yield framed(i, obj)
            if include_usage:
                yield sse(make_chunk(None, None, usage=usage(
                    sum(n_prompt), sum(completion), cached[0] if details else None)))
        except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band
            status, body = error_json(exc)
            logger.warning("stream failed (%d): %s", status, body["error"]["message"])
            yield sse(body)
        yield b"data: [DONE]\n\n"
