"""POST /v1/chat/completions: the chat template, then OpenAI's chat shapes (role chunk first).

With tools (tool_calls.py) the answer carries `message.tool_calls` and finish_reason
"tool_calls"; streamed, tool calls arrive as OpenAI's tool-call deltas (tool_parsers.py)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from shoal.engine.entrypoints import llama3_json_tool_calls, logprobs_format, structured_request
from shoal.engine.entrypoints.http_errors import GENERATION_ERRORS, error_json, error_responses
from shoal.engine.entrypoints.protocol import ChatCompletionRequest, usage_flags
from shoal.engine.entrypoints.reasoning import ReasoningParser, ReasoningStream
from shoal.engine.entrypoints.serving import (
    Collected,
    Serving,
    collect,
    merged_choices,
    sse,
    until_disconnect,
    usage,
)
from shoal.engine.entrypoints.serving_responses import responses_router
from shoal.engine.entrypoints.tool_calls import ToolPlan, ToolSettings, plan_tools
from shoal.engine.entrypoints.tool_parsers import ToolCallStream, calls_in, message_tool_calls
from shoal.engine.errors import InvalidRequestError

logger = logging.getLogger("shoal.engine.api")


def _constrain_for_tools(params, plan: ToolPlan | None) -> None:
    """Tool choice "required" or a named function: the output follows the tools' grammar."""
    if plan is None or plan.structured_outputs is None:
        return
    if params.structured_outputs is not None:
        raise InvalidRequestError("response_format / structured_outputs / guided_* cannot be "
                                  f"combined with tool_choice {plan.mode!r}: the tool call "
                                  "already constrains the output.")
    structured_request.check(plan.structured_outputs, "tools (function parameters)")
    params.structured_outputs = plan.structured_outputs


def _finish(reason: str | None, has_calls: bool) -> str | None:
    return "tool_calls" if has_calls and reason == "stop" else reason


def chat_router(s: Serving, tool_settings: ToolSettings | None = None) -> APIRouter:
    router = APIRouter()
    settings = tool_settings or ToolSettings()
    if settings.tool_call_parser == "llama3_json":
        llama3_json_tool_calls.check_tokenizer(s.llm.tokenizer)
    reasoner = (ReasoningParser.load(settings.reasoning_parser, s.llm.tokenizer)
                if settings.reasoning_parser else None)

    @router.post("/v1/chat/completions", responses=error_responses(*GENERATION_ERRORS))
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        lora = s.check_model(body.model)
        body.check_supported()
        plan = plan_tools(body, settings)
        s.ensure_available()
        kwargs = body.template_kwargs()
        prompt = s.prompt_of(body, s.llm.input_processor.render_chat(
            [m.template_dict() for m in body.messages], body.add_generation_prompt,
            tools=plan.template_tools if plan else None, template_kwargs=kwargs))
        params = _chat_params(s, body, plan)
        think = _Thinking(reasoner, reasoner is not None and reasoner.thinks(kwargs))
        think.check(params)
        request_id = s.request_id(request, body, "chatcmpl-")
        gens = s.start_choices([prompt], params, body.n, request_id, s.priority(request, body),
                               lora)
        n_prompt = [len(prompt)] * body.n
        head = {"id": request_id, "object": "chat.completion", "created": int(time.time()),
                "model": s.response_model(lora)}
        if plan is not None and plan.mode != "none":
            if body.stream:
                return StreamingResponse(
                    _tool_stream(s, body, plan, gens, head, n_prompt, think,
                                 s.prompt_details(request)),
                    media_type="text/event-stream")
            return await _tool_response(request, plan, gens, head, n_prompt, think,
                                        s.prompt_details(request))
        if body.stream:
            return _text_stream(s, body, gens, head, n_prompt, prompt, think,
                                s.prompt_details(request))
        wants = body.logprobs or body.prompt_logprobs is not None or body.return_token_ids
        return await s.respond(request, gens, n_prompt, head,
                               lambda text: {"message": think.message(text)},
                               add_logprobs=(_response_filler(body, prompt, s.tokens_as_ids(body))
                                             if wants else None))

    s.endpoints['chat'] = (ChatCompletionRequest, chat_completions)
    router.include_router(responses_router(s))  # /v1/responses answers through this endpoint
    return router


@dataclass(frozen=True)
class _Thinking:
    """One request's reasoning split (reasoning.py): the server's parser, and whether this
    request thinks (qwen3's enable_thinking); without a parser, content is the whole text."""

    parser: ReasoningParser | None
    on: bool

    def check(self, params) -> None:
        if self.parser is not None and self.on and params.structured_outputs is not None:
            raise InvalidRequestError(
                "structured output (response_format, structured_outputs, guided_*, forced "
                "tool_choice) is not implemented with --reasoning-parser while the model "
                "thinks: the grammar would apply from the first token, not after the "
                "reasoning. Send chat_template_kwargs {\"enable_thinking\": false} (qwen3) "
                "or serve without --reasoning-parser.")

    def split(self, text: str) -> tuple[str | None, str | None]:
        if self.parser is None:
            return None, text
        return self.parser.split(text, self.on)

    def message(self, text: str) -> dict:
        reasoning, content = self.split(text)
        message = {"role": "assistant", "content": content}
        if self.parser is not None:
            message["reasoning"] = reasoning
        return message

    def streams(self, n: int) -> list[ReasoningStream] | None:
        return None if self.parser is None else [self.parser.stream(self.on) for _ in range(n)]


def _chat_params(s: Serving, body: ChatCompletionRequest, plan: ToolPlan | None):
    """The request's SamplingParams, constrained by its tool plan; 400 for what tools exclude."""
    params = body.sampling_params(default_max_tokens=None,
                                  max_logprobs=s.llm.config.max_logprobs,
                                  defaults=s.sampling_defaults)
    _constrain_for_tools(params, plan)
    if plan is not None and plan.mode == "auto":
        params.skip_special_tokens = False  # <tool_call> may be a special token (vLLM's hermes)
    if plan is not None and plan.mode != "none" and (
            body.logprobs or body.prompt_logprobs is not None):
        raise InvalidRequestError("logprobs and prompt_logprobs are not implemented for "
                                  "responses with tools (tool_choice "
                                  f"{plan.mode!r}); send them without tools.")
    return params


def _text_stream(s: Serving, body: ChatCompletionRequest, gens, head: dict,
                 n_prompt: list[int], prompt: list[int], think: _Thinking,
                 details: bool = False) -> StreamingResponse:
    """SSE of a chat answer without tool calls: the role delta first, then content deltas
    (with a reasoning parser, `reasoning` and `content` deltas as vLLM splits them). With
    return_token_ids, vLLM's shape: the first chunk carries `prompt_token_ids`, each delta its
    `token_ids`."""
    base = {**head, "object": "chat.completion.chunk"}
    reasoning = think.streams(len(gens))
    as_ids = s.tokens_as_ids(body)

    def chunk(i, out, usage=None, delta=None):
        obj = {**base, "choices": []}
        if usage is not None:
            obj["usage"] = usage
            return obj
        lp = None
        if out is not None:
            if reasoning is None:
                delta = {"content": out.text} if out.text else {}
            else:
                delta = reasoning[i].feed(out.text, out.token_ids) if out.text else {}
                if delta is None and not out.finished:  # a lone think token: nothing sent
                    return None
                delta = delta or {}
            if body.logprobs:
                lp = logprobs_format.chat_logprobs(out.logprobs or [], as_ids)
        obj["choices"].append({"index": i, "delta": delta, "logprobs": lp,
                               "finish_reason": out.finish_reason if out else None,
                               "stop_reason": out.stop_reason if out else None})
        if body.return_token_ids and out is not None:
            obj["choices"][-1]["token_ids"] = out.token_ids
        return obj

    role = [chunk(i, None, delta={"role": "assistant", "content": ""})
            for i in range(len(gens))]
    if body.return_token_ids:
        role[0]["prompt_token_ids"] = prompt
    return StreamingResponse(
        s.stream_events(gens, chunk, n_prompt, usage_flags(body.stream_options), role, details),
        media_type="text/event-stream")


def _response_filler(body: ChatCompletionRequest, prompt: list[int], as_ids: bool = False):
    """add_logprobs for Serving.respond: chat's logprobs per choice (tokens as "token_id:{id}"
    with `as_ids`), prompt_logprobs once; return_token_ids as vLLM shapes it
    (`prompt_token_ids` on the response, `token_ids` on each choice)."""

    def add_logprobs(response: dict, c: Collected) -> None:
        if body.return_token_ids:
            response["prompt_token_ids"] = prompt
            for i, choice in enumerate(response["choices"]):
                choice["token_ids"] = c.token_ids[i]
        if body.logprobs:
            for i, choice in enumerate(response["choices"]):
                choice["logprobs"] = logprobs_format.chat_logprobs(c.logprobs[i] or [], as_ids)
        if body.prompt_logprobs is not None:  # vLLM: on the response, the prompt is shared
            response["prompt_logprobs"] = logprobs_format.prompt_logprobs(
                c.prompt_logprobs[0] or [None])

    return add_logprobs


async def _tool_response(request: Request, plan: ToolPlan, gens, head: dict,
                         n_prompt: list[int], think: _Thinking, details: bool = False
                         ) -> Response:
    c = await until_disconnect(request, collect(gens))
    if c is None:
        return Response(status_code=499)
    choices = []
    for i, whole in enumerate(c.texts):
        reasoning, text = think.split(whole)  # tool calls are read after the reasoning
        text = text or ""
        content, calls = calls_in(plan, text)
        if c.finish[i] != "stop" and plan.mode == "auto":  # free text cut short: as written
            content, calls = text, []
        # A forced call ("required", named) cut short keeps its calls with the arguments so far
        # (not JSON), and finish_reason says "length": as OpenAI answers, never plain text.
        message: dict = {"role": "assistant", "content": content or None}
        if think.parser is not None:
            message["reasoning"] = reasoning
        if calls:
            message["tool_calls"] = message_tool_calls(calls)
        logger.info("%s: choice %d: %d tool calls (%s)", head["id"], i, len(calls), plan.mode)
        choices.append({"index": i, "message": message, "logprobs": None,
                        "finish_reason": _finish(c.finish[i], bool(calls)),
                        "stop_reason": c.stop_reason[i]})
    return JSONResponse({**head, "object": "chat.completion", "choices": choices,
                         "usage": c.usage(n_prompt, details)})


async def _tool_stream(s: Serving, body, plan: ToolPlan, gens, head: dict, n_prompt: list[int],
                       think: _Thinking, details: bool = False):
    """SSE with tool-call deltas (after the reasoning deltas, with a reasoning parser); the
    same framing as Serving.stream_events."""
    include_usage, continuous = usage_flags(body.stream_options)
    base = {**head, "object": "chat.completion.chunk"}

    def chunk(i, delta, finish=None, stop_reason=None):
        obj = {**base, "choices": [{"index": i, "delta": delta, "logprobs": None,
                                    "finish_reason": finish, "stop_reason": stop_reason}]}
        if continuous:
            obj["usage"] = usage(n_prompt[i], completion[i])
        return sse(obj)

    streams = [ToolCallStream(plan) for _ in gens]
    reasoning = think.streams(len(gens))
    completion = [0] * len(gens)
    cached = [0] * len(gens)
    try:
        for i in range(len(gens)):
            yield chunk(i, {"role": "assistant", "content": ""})
        async for i, out in merged_choices(gens):
            completion[i] = out.num_output_tokens
            cached[i] = max(cached[i], out.num_cached_tokens)
            text = out.text
            if reasoning is not None and text:
                split = reasoning[i].feed(text, out.token_ids) or {}
                if split.get("reasoning"):
                    yield chunk(i, {"reasoning": split["reasoning"]})
                text = split.get("content") or ""
            for delta in streams[i].feed(text, final=out.finished):
                yield chunk(i, delta)
            if out.finished:
                yield chunk(i, {}, _finish(out.finish_reason, streams[i].num_calls > 0),
                            out.stop_reason)
        if include_usage:
            yield sse({**base, "choices": [], "usage": usage(
                sum(n_prompt), sum(completion), cached[0] if details else None)})
    except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band
        status, err = error_json(exc)
        logger.warning("stream failed (%d): %s", status, err["error"]["message"])
        yield sse(err)
    yield b"data: [DONE]\n\n"
