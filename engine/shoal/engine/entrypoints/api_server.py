"""The OpenAI-compatible HTTP surface (FastAPI), on top of one AsyncLLM.

Responses and SSE chunks follow OpenAI's (and vLLM's) shapes. Every error is OpenAI's error JSON
`{"error": {"message", "type", "param", "code"}}` with the status that says whose fault it is:
400 bad input (the message says what to change), 401 wrong/missing API key, 404 unknown model
(as OpenAI and vLLM answer), 503 engine unavailable (shutting down), 500 engine death (the message
names the process, rank and root cause). A stream that already sent 200 ends with an error event
and `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from shoal.engine import __version__
from shoal.engine.entrypoints.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from shoal.engine.frontend.async_llm import AsyncLLM
from shoal.engine.frontend.errors import InvalidRequestError, RequestError
from shoal.engine.frontend.output_processor import RequestOutput
from shoal.engine.mp_client import EngineDeadError
from shoal.engine.wire import SamplingParams
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("shoal.engine.api")
_json = msgspec.json.Encoder()


def error_response(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": status}}, status_code=status)


def _error_json(exc: BaseException) -> tuple[int, dict]:
    if isinstance(exc, EngineDeadError):
        status, kind, msg = 500, "EngineDeadError", str(exc)
    elif isinstance(exc, RequestError):
        status, kind, msg = exc.status, exc.kind, str(exc)
    else:
        status, kind, msg = 500, "InternalServerError", f"{type(exc).__name__}: {exc}"
    return status, {"error": {"message": msg, "type": kind, "param": None, "code": status}}


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        if err.get("type") == "json_invalid":
            return "the request body is not valid JSON; send a JSON object."
        parts.append(f"{loc or 'body'}: {err.get('msg')}")
    return "invalid request: " + "; ".join(parts[:5])


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def _choices(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
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


async def _until_disconnect(request: Request, coro):
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


def build_app(llm: AsyncLLM, *, served_model_names: list[str], api_key: str | None = None,
              on_health_fail=None) -> FastAPI:
    app = FastAPI(title="shoal", version=__version__, docs_url=None, redoc_url=None)
    app.state.llm = llm
    model_name = served_model_names[0]

    # ----- errors ----------------------------------------------------------------------------

    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, exc: RequestValidationError):
        return error_response(400, _validation_message(exc), "BadRequestError")

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(request: Request, exc: StarletteHTTPException):
        kind = {404: "NotFoundError", 405: "MethodNotAllowedError"}.get(exc.status_code, "Error")
        return error_response(exc.status_code, str(exc.detail), kind)

    @app.exception_handler(RequestError)
    async def _on_request_error(request: Request, exc: RequestError):
        status, body = _error_json(exc)
        return JSONResponse(body, status_code=status)

    @app.exception_handler(EngineDeadError)
    async def _on_dead(request: Request, exc: EngineDeadError):
        status, body = _error_json(exc)
        return JSONResponse(body, status_code=status)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1"):
            header = request.headers.get("authorization", "")
            if header != f"Bearer {api_key}":
                return error_response(
                    401, "invalid or missing API key: send 'Authorization: Bearer <key>' with "
                         "the key given to --api-key", "AuthenticationError")
        return await call_next(request)

    def check_model(name: str | None) -> None:
        if name is not None and name not in served_model_names:
            raise RequestError(f"The model `{name}` does not exist. Served models: "
                               f"{served_model_names}.", 404)

    def ensure_available() -> None:
        llm._check_available()

    # ----- plumbing shared by completions and chat --------------------------------------------

    def start_choices(prompts: list[list[int]], params: SamplingParams, n: int,
                      request_id: str) -> list[AsyncIterator[RequestOutput]]:
        per_choice = []
        for ids in prompts:
            for j in range(n):
                p = msgspec.structs.replace(params, seed=None if params.seed is None
                                            else params.seed + j)
                # Validate now, so a bad request is a 400 before any stream starts.
                llm.input_processor.process("validate", ids, msgspec.structs.replace(p))
                per_choice.append((ids, p))
        return [llm.generate(ids, p, f"{request_id}-{i}") for i, (ids, p) in enumerate(per_choice)]

    async def collect(gens):
        texts = [""] * len(gens)
        tokens: list[list[int]] = [[] for _ in gens]
        finish: list[str | None] = [None] * len(gens)
        stop_reason: list = [None] * len(gens)
        completion = [0] * len(gens)
        async for i, out in _choices(gens):
            texts[i] += out.text
            tokens[i] += out.token_ids
            completion[i] = out.num_output_tokens
            if out.finished:
                finish[i], stop_reason[i] = out.finish_reason, out.stop_reason
        return texts, finish, stop_reason, completion, tokens

    async def respond(request: Request, gens, n_prompt: list[int], head: dict,
                      choice_body, prompt_ids: list[list[int]] | None = None) -> Response:
        """The non-streaming answer: every choice collected, its body `choice_body(text)`; 499 if
        the client left first (its requests are aborted). With `prompt_ids` (vLLM's
        return_token_ids) each choice also carries its prompt's and its own token ids."""
        result = await _until_disconnect(request, collect(gens))
        if result is None:
            return Response(status_code=499)
        texts, finish, stops, completion, tokens = result
        choices = [{"index": i, **choice_body(texts[i]), "logprobs": None,
                    "finish_reason": finish[i], "stop_reason": stops[i]}
                   for i in range(len(gens))]
        if prompt_ids is not None:
            for i, c in enumerate(choices):
                c["prompt_token_ids"], c["token_ids"] = prompt_ids[i], tokens[i]
        return JSONResponse({**head, "choices": choices,
                             "usage": _usage(sum(n_prompt), sum(completion))})

    def sse(obj) -> bytes:
        return b"data: " + _json.encode(obj) + b"\n\n"

    async def stream_events(gens, make_chunk, n_prompt: list[int], include_usage: bool,
                            first_chunks: list[bytes]) -> AsyncIterator[bytes]:
        completion = [0] * len(gens)
        try:
            for c in first_chunks:
                yield c
            async for i, out in _choices(gens):
                completion[i] = out.num_output_tokens
                if out.text or out.finished:
                    yield sse(make_chunk(i, out))
            if include_usage:
                yield sse(make_chunk(None, None, usage=_usage(sum(n_prompt), sum(completion))))
        except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band
            status, body = _error_json(exc)
            logger.warning("stream failed (%d): %s", status, body["error"]["message"])
            yield sse(body)
        yield b"data: [DONE]\n\n"

    # ----- endpoints --------------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        body.check_supported()
        ensure_available()
        prompts = [llm.input_processor.tokenize(p) if isinstance(p, str) else list(p)
                   for p in body.prompts()]
        params = body.sampling_params(default_max_tokens=16)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        gens = start_choices(prompts, params, body.n, request_id)
        n_prompt = [len(p) for p in prompts for _ in range(body.n)]

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            def chunk(i, out, usage=None):
                obj = {"id": request_id, "object": "text_completion", "created": created,
                       "model": model_name, "choices": []}
                if usage is not None:
                    obj["usage"] = usage
                else:
                    obj["choices"].append({"index": i, "text": out.text, "logprobs": None,
                                           "finish_reason": out.finish_reason,
                                           "stop_reason": out.stop_reason})
                    if body.return_token_ids:
                        obj["choices"][-1]["token_ids"] = out.token_ids
                return obj

            return StreamingResponse(stream_events(gens, chunk, n_prompt, include_usage, []),
                                     media_type="text/event-stream")

        head = {"id": request_id, "object": "text_completion", "created": created,
                "model": model_name}
        prompt_ids = ([p for p in prompts for _ in range(body.n)] if body.return_token_ids
                      else None)
        return await respond(request, gens, n_prompt, head, lambda text: {"text": text},
                             prompt_ids)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        body.check_supported()
        ensure_available()
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        prompt = llm.input_processor.render_chat(messages, body.add_generation_prompt)
        params = body.sampling_params(default_max_tokens=None)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        gens = start_choices([prompt], params, body.n, request_id)
        n_prompt = [len(prompt)] * body.n

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            def chunk(i, out, usage=None, delta=None):
                obj = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                       "model": model_name, "choices": []}
                if usage is not None:
                    obj["usage"] = usage
                    return obj
                if delta is None:
                    delta = {"content": out.text} if out.text else {}
                obj["choices"].append({"index": i, "delta": delta, "logprobs": None,
                                       "finish_reason": out.finish_reason if out else None,
                                       "stop_reason": out.stop_reason if out else None})
                return obj

            role = [sse(chunk(i, None, delta={"role": "assistant", "content": ""}))
                    for i in range(len(gens))]
            return StreamingResponse(stream_events(gens, chunk, n_prompt, include_usage, role),
                                     media_type="text/event-stream")

        head = {"id": request_id, "object": "chat.completion", "created": created,
                "model": model_name}
        return await respond(request, gens, n_prompt, head,
                             lambda text: {"message": {"role": "assistant", "content": text}})

    @app.get("/v1/models")
    async def models():
        created = int(time.time())
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "shoal",
             "root": llm.config.model, "parent": None, "max_model_len": llm.max_model_len}
            for name in served_model_names]}

    @app.get("/health")
    async def health():
        if llm.dead_error is not None:
            return error_response(503, str(llm.dead_error), "EngineDeadError")
        if not llm.is_healthy:
            return error_response(503, "the server is shutting down", "ServiceUnavailableError")
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics():
        return Response(llm.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        if body.messages is not None:
            ids = llm.input_processor.render_chat(
                [{"role": m.role, "content": m.text()} for m in body.messages],
                body.add_generation_prompt)
        elif body.prompt is not None:
            ids = llm.input_processor.tokenize(body.prompt, body.add_special_tokens)
        else:
            raise InvalidRequestError("send either 'prompt' or 'messages'.")
        return {"count": len(ids), "max_model_len": llm.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        vocab = llm.input_processor.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token ids {bad[:5]} are outside the vocabulary "
                                      f"[0, {vocab}).")
        return {"prompt": llm.tokenizer.decode(body.tokens)}

    return app
