"""POST /v1/completions: OpenAI's legacy completions, vLLM's extensions (return_token_ids)."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from shoal.engine.entrypoints.http_errors import GENERATION_ERRORS, error_responses
from shoal.engine.entrypoints.protocol import CompletionRequest
from shoal.engine.entrypoints.serving import Serving


def completions_router(s: Serving) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/completions", responses=error_responses(*GENERATION_ERRORS))
    async def completions(body: CompletionRequest, request: Request):
        s.check_model(body.model)
        body.check_supported()
        s.ensure_available()
        llm = s.llm
        prompts = [llm.input_processor.tokenize(p) if isinstance(p, str) else list(p)
                   for p in body.prompts()]
        params = body.sampling_params(default_max_tokens=16)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        gens = s.start_choices(prompts, params, body.n, request_id)
        n_prompt = [len(p) for p in prompts for _ in range(body.n)]

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            def chunk(i, out, usage=None):
                obj = {"id": request_id, "object": "text_completion", "created": created,
                       "model": s.model_name, "choices": []}
                if usage is not None:
                    obj["usage"] = usage
                else:
                    obj["choices"].append({"index": i, "text": out.text, "logprobs": None,
                                           "finish_reason": out.finish_reason,
                                           "stop_reason": out.stop_reason})
                    if body.return_token_ids:
                        obj["choices"][-1]["token_ids"] = out.token_ids
                return obj

            return StreamingResponse(s.stream_events(gens, chunk, n_prompt, include_usage, []),
                                     media_type="text/event-stream")

        head = {"id": request_id, "object": "text_completion", "created": created,
                "model": s.model_name}
        prompt_ids = ([p for p in prompts for _ in range(body.n)] if body.return_token_ids
                      else None)
        return await s.respond(request, gens, n_prompt, head, lambda text: {"text": text},
                               prompt_ids)

    return router
