"""POST /v1/completions: OpenAI's legacy completions (echo and logprobs included), vLLM's
extensions (return_token_ids, prompt_logprobs)."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from shoal.engine.entrypoints import logprobs_format
from shoal.engine.entrypoints.http_errors import GENERATION_ERRORS, error_responses
from shoal.engine.entrypoints.protocol import CompletionRequest
from shoal.engine.entrypoints.serving import Collected, Serving


def completions_router(s: Serving) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/completions", responses=error_responses(*GENERATION_ERRORS))
    async def completions(body: CompletionRequest, request: Request):
        s.check_model(body.model)
        body.check_supported()
        s.ensure_available()
        llm = s.llm
        texts = body.prompts()
        prompts = [llm.input_processor.tokenize(p) if isinstance(p, str) else list(p)
                   for p in texts]
        params = body.sampling_params(default_max_tokens=16,
                                      max_logprobs=llm.config.max_logprobs)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        gens = s.start_choices(prompts, params, body.n, request_id)
        n_prompt = [len(p) for p in prompts for _ in range(body.n)]
        token_string = llm.output_processor.token_string
        echo_texts = ([t if isinstance(t, str) else llm.tokenizer.decode(t) for t in texts]
                      if body.echo else [])

        def with_echo(i, text, ids, positions, prompt_positions):
            """The echoed prompt's text, tokens and logprobs in front of choice i's own."""
            p = i // body.n
            if positions is not None:
                positions = (prompt_positions or [None] * len(prompts[p])) + positions
            return echo_texts[p] + text, prompts[p] + ids, positions

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            echoed, offset = [False] * len(gens), [0] * len(gens)

            def chunk(i, out, usage=None):
                obj = {"id": request_id, "object": "text_completion", "created": created,
                       "model": s.model_name, "choices": []}
                if usage is not None:
                    obj["usage"] = usage
                    return obj
                text, ids, positions = out.text, out.token_ids, out.logprobs
                if body.logprobs is not None and positions is None:
                    positions = []  # an abort: no token
                if body.echo and not echoed[i]:
                    echoed[i] = True
                    text, ids, positions = with_echo(i, text, ids, positions,
                                                     out.prompt_logprobs)
                lp = None
                if body.logprobs is not None:  # offsets go on from the previous chunk's tokens
                    lp = logprobs_format.completion_logprobs(ids, positions, token_string,
                                                             offset[i])
                    offset[i] += sum(map(len, lp["tokens"]))
                obj["choices"].append({"index": i, "text": text, "logprobs": lp,
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
        def add_logprobs(response: dict, c: Collected) -> None:
            for i, choice in enumerate(response["choices"]):
                ids, positions = c.token_ids[i], c.logprobs[i]
                if body.logprobs is not None and positions is None:
                    positions = []
                if body.echo:
                    choice["text"], ids, positions = with_echo(
                        i, choice["text"], ids, positions, c.prompt_logprobs[i])
                if body.logprobs is not None:
                    choice["logprobs"] = logprobs_format.completion_logprobs(
                        ids, positions, token_string)
                if body.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = logprobs_format.prompt_logprobs(
                        c.prompt_logprobs[i] or [None])

        wants = body.echo or body.logprobs is not None or body.prompt_logprobs is not None
        return await s.respond(request, gens, n_prompt, head, lambda text: {"text": text},
                               prompt_ids, add_logprobs if wants else None)

    return router
