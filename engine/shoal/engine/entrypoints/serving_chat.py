"""POST /v1/chat/completions: the chat template, then OpenAI's chat shapes (role chunk first)."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from shoal.engine.entrypoints import logprobs_format
from shoal.engine.entrypoints.protocol import ChatCompletionRequest
from shoal.engine.entrypoints.serving import Collected, Serving, sse


def chat_router(s: Serving) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        s.check_model(body.model)
        body.check_supported()
        s.ensure_available()
        llm = s.llm
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        prompt = llm.input_processor.render_chat(messages, body.add_generation_prompt)
        params = body.sampling_params(default_max_tokens=None,
                                      max_logprobs=llm.config.max_logprobs)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        gens = s.start_choices([prompt], params, body.n, request_id)
        n_prompt = [len(prompt)] * body.n

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            def chunk(i, out, usage=None, delta=None):
                obj = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                       "model": s.model_name, "choices": []}
                if usage is not None:
                    obj["usage"] = usage
                    return obj
                lp = None
                if delta is None:
                    delta = {"content": out.text} if out.text else {}
                    if body.logprobs:
                        lp = logprobs_format.chat_logprobs(out.logprobs or [])
                obj["choices"].append({"index": i, "delta": delta, "logprobs": lp,
                                       "finish_reason": out.finish_reason if out else None,
                                       "stop_reason": out.stop_reason if out else None})
                return obj

            role = [sse(chunk(i, None, delta={"role": "assistant", "content": ""}))
                    for i in range(len(gens))]
            return StreamingResponse(s.stream_events(gens, chunk, n_prompt, include_usage, role),
                                     media_type="text/event-stream")

        head = {"id": request_id, "object": "chat.completion", "created": created,
                "model": s.model_name}
        def add_logprobs(response: dict, c: Collected) -> None:
            if body.logprobs:
                for i, choice in enumerate(response["choices"]):
                    choice["logprobs"] = logprobs_format.chat_logprobs(c.logprobs[i] or [])
            if body.prompt_logprobs is not None:  # vLLM: on the response, the prompt is shared
                response["prompt_logprobs"] = logprobs_format.prompt_logprobs(
                    c.prompt_logprobs[0] or [None])

        wants = body.logprobs or body.prompt_logprobs is not None
        return await s.respond(request, gens, n_prompt, head,
                               lambda text: {"message": {"role": "assistant", "content": text}},
                               add_logprobs=add_logprobs if wants else None)

    return router
