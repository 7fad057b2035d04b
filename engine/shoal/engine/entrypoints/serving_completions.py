"""POST /v1/completions: OpenAI's legacy completions (echo and logprobs included), vLLM's
extensions (return_token_ids, prompt_logprobs)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from shoal.engine.entrypoints import logprobs_format
from shoal.engine.entrypoints.http_errors import GENERATION_ERRORS, error_responses
from shoal.engine.entrypoints.protocol import CompletionRequest, usage_flags
from shoal.engine.entrypoints.serving import Collected, Serving


def completions_router(s: Serving) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/completions", responses=error_responses(*GENERATION_ERRORS))
    async def completions(body: CompletionRequest, request: Request):
        lora = s.check_model(body.model)
        body.check_supported()
        s.ensure_available()
        job = _CompletionJob.start(s, body)
        job.model_name = s.response_model(lora)
        job.request_id = s.request_id(request, body, "cmpl-")
        job.as_ids = s.tokens_as_ids(body)
        params = body.sampling_params(default_max_tokens=16,
                                      max_logprobs=s.llm.config.max_logprobs,
                                      defaults=s.sampling_defaults)
        gens = s.start_choices(job.prompts, params, body.n, job.request_id,
                               s.priority(request, body), lora)
        n_prompt = [len(p) for p in job.prompts for _ in range(body.n)]
        if body.stream:
            job.echoed, job.offset = [False] * len(gens), [0] * len(gens)
            return StreamingResponse(
                s.stream_events(gens, job.chunk, n_prompt, usage_flags(body.stream_options), [],
                                s.prompt_details(request)),
                media_type="text/event-stream")
        prompt_ids = ([p for p in job.prompts for _ in range(body.n)]
                      if body.return_token_ids else None)
        wants = body.echo or body.logprobs is not None or body.prompt_logprobs is not None
        return await s.respond(request, gens, n_prompt, job.head(),
                               lambda text: {"text": text}, prompt_ids,
                               job.add_logprobs if wants else None)

    s.endpoints['completion'] = (CompletionRequest, completions)
    return router


@dataclass
class _CompletionJob:
    """One completions request's prompts and the shapes of its answer (chunks, logprobs)."""

    body: CompletionRequest
    model_name: str
    token_string: object  # OutputProcessor.token_string: token id -> its text
    texts: list  # the prompts as sent (text or token ids)
    prompts: list[list[int]]
    echo_texts: list[str]
    request_id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))
    echoed: list[bool] = field(default_factory=list)  # streaming: the echo went out
    offset: list[int] = field(default_factory=list)  # streaming: text_offset so far
    as_ids: bool = False  # logprob tokens as "token_id:{id}"

    @classmethod
    def start(cls, s: Serving, body: CompletionRequest) -> _CompletionJob:
        llm = s.llm
        texts = body.prompts()
        prompts = [s.prompt_of(body, llm.input_processor.tokenize(p) if isinstance(p, str)
                               else list(p)) for p in texts]
        cut = body.truncate_prompt_tokens is not None  # the echo is the prompt as truncated
        echo_texts = ([t if isinstance(t, str) and not cut else llm.tokenizer.decode(ids)
                       for t, ids in zip(texts, prompts, strict=True)]
                      if body.echo else [])
        return cls(body, s.model_name, llm.output_processor.token_string, texts, prompts,
                   echo_texts)

    def head(self) -> dict:
        return {"id": self.request_id, "object": "text_completion", "created": self.created,
                "model": self.model_name}

    def with_echo(self, i, text, ids, positions, prompt_positions):
        """The echoed prompt's text, tokens and logprobs in front of choice i's own."""
        p = i // self.body.n
        if positions is not None:
            positions = (prompt_positions or [None] * len(self.prompts[p])) + positions
        return self.echo_texts[p] + text, self.prompts[p] + ids, positions

    def chunk(self, i, out, usage=None):
        """One SSE chunk of choice i (or the usage chunk)."""
        body = self.body
        obj = {**self.head(), "choices": []}
        if usage is not None:
            obj["usage"] = usage
            return obj
        text, ids, positions = out.text, out.token_ids, out.logprobs
        if body.logprobs is not None and positions is None:
            positions = []  # an abort: no token
        if body.echo and not self.echoed[i]:
            self.echoed[i] = True
            text, ids, positions = self.with_echo(i, text, ids, positions, out.prompt_logprobs)
        lp = None
        if body.logprobs is not None:  # offsets go on from the previous chunk's tokens
            lp = logprobs_format.completion_logprobs(ids, positions, self.token_string,
                                                     self.offset[i], self.as_ids)
            self.offset[i] += sum(map(len, lp["tokens"]))
        obj["choices"].append({"index": i, "text": text, "logprobs": lp,
                               "finish_reason": out.finish_reason,
                               "stop_reason": out.stop_reason})
        if body.return_token_ids:
            obj["choices"][-1]["token_ids"] = out.token_ids
        return obj

    def add_logprobs(self, response: dict, c: Collected) -> None:
        """The non-streaming answer's echo, logprobs and prompt_logprobs, in place."""
        body = self.body
        for i, choice in enumerate(response["choices"]):
            ids, positions = c.token_ids[i], c.logprobs[i]
            if body.logprobs is not None and positions is None:
                positions = []
            if body.echo:
                choice["text"], ids, positions = self.with_echo(
                    i, choice["text"], ids, positions, c.prompt_logprobs[i])
            if body.logprobs is not None:
                choice["logprobs"] = logprobs_format.completion_logprobs(
                    ids, positions, self.token_string, as_ids=self.as_ids)
            if body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = logprobs_format.prompt_logprobs(
                    c.prompt_logprobs[i] or [None])
