"""The endpoints around generation: models, health (and SageMaker's /ping), version, metrics,
tokenize, detokenize; vLLM's development-mode /reset_prefix_cache."""

from __future__ import annotations

import logging
import os
import time

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from shoal.engine import __version__
from shoal.engine.entrypoints.http_errors import TOKENIZER_ERRORS, error_response, error_responses
from shoal.engine.entrypoints.protocol import DetokenizeRequest, TokenizeRequest
from shoal.engine.entrypoints.serving import Serving
from shoal.engine.errors import RETRY_AFTER_S, InvalidRequestError
from shoal.engine.frontend.metrics import exposition

logger = logging.getLogger("shoal.engine.api")
# vLLM's switch for its development endpoints (/reset_prefix_cache among them): off in
# production, as there.
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"


def _health(llm):
    """/health's (and /ping's) answer: 200 empty while admitting, else 503 with the reason."""
    if llm.dead_error is not None:
        return error_response(503, str(llm.dead_error), "EngineDeadError")
    if not llm.is_healthy:
        return error_response(503, "the server is shutting down", "ServiceUnavailableError",
                              retry_after=RETRY_AFTER_S)
    return PlainTextResponse("")


def admin_router(s: Serving) -> APIRouter:
    router = APIRouter()
    llm = s.llm

    def health_response():
        return _health(llm)

    @router.get("/v1/models", responses=error_responses(401))
    async def models():
        created = int(time.time())
        cards = [{"id": name, "object": "model", "created": created, "owned_by": "shoal",
                  "root": llm.config.model, "parent": None, "max_model_len": llm.max_model_len}
                 for name in s.served_model_names]
        for lora in (s.loras.adapters.values() if s.loras is not None else ()):  # vLLM's cards
            cards.append({"id": lora.lora_name, "object": "model", "created": created,
                          "owned_by": "shoal", "root": lora.lora_path,
                          "parent": lora.base_model_name or s.model_name,
                          "max_model_len": None})
        return {"object": "list", "data": cards}

    @router.get("/health", response_class=PlainTextResponse, responses={
        200: {"description": "Healthy: an empty text/plain body."}, **error_responses(503)})
    async def health():
        """200 with an empty text/plain body while the server admits requests (vLLM answers
        200 with an empty body); 503 with OpenAI's error JSON once the engine is dead or the
        server is shutting down, the latter with Retry-After (the probe takes it out of
        rotation)."""
        return health_response()

    _add_vllm_extras(router, llm, health_response)
    _add_unserved(router)

    @router.get("/version")
    async def version():
        return {"version": __version__}

    @router.get("/metrics", response_class=Response, responses={
        200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text format."}})
    async def metrics(request: Request):
        """Every series, or with `name[]` query parameters only those (prometheus_client's
        filter, which vLLM's /metrics takes too): a router reading three gauges every probe
        round costs the server a tenth of the whole text's CPU (4.9 against 0.6 ms for the
        tiny model's 36 KB)."""
        names = request.query_params.getlist("name[]") or None
        text = llm.metrics.render(names)
        if s.http_metrics is not None:  # vLLM's http_* series (http_metrics.py)
            text += exposition(s.http_metrics, names)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @router.post("/tokenize", responses=error_responses(*TOKENIZER_ERRORS))
    async def tokenize(body: TokenizeRequest):
        s.check_model(body.model)
        if body.messages is not None:
            ids = llm.input_processor.render_chat(
                [{"role": m.role, "content": m.text()} for m in body.messages],
                body.add_generation_prompt, add_special_tokens=body.special_tokens())
        elif body.prompt is not None:
            ids = llm.input_processor.tokenize(body.prompt, body.special_tokens())
        else:
            raise InvalidRequestError("send either 'prompt' or 'messages'.")
        return {"count": len(ids), "max_model_len": llm.max_model_len, "tokens": ids}

    @router.post("/detokenize", responses=error_responses(*TOKENIZER_ERRORS))
    async def detokenize(body: DetokenizeRequest):
        s.check_model(body.model)
        vocab = llm.input_processor.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token ids {bad[:5]} are outside the vocabulary "
                                      f"[0, {vocab}).")
        return {"prompt": llm.tokenizer.decode(body.tokens)}

    return router


def _add_vllm_extras(router: APIRouter, llm, health_response) -> None:
    """SageMaker's /ping, and vLLM's development-mode /reset_prefix_cache."""

    @router.get("/ping", response_class=PlainTextResponse, responses={
        200: {"description": "Healthy: an empty text/plain body."}, **error_responses(503)})
    @router.post("/ping", response_class=PlainTextResponse, responses={
        200: {"description": "Healthy: an empty text/plain body."}, **error_responses(503)})
    async def ping():
        """SageMaker's health check: /health's answer (vLLM's /ping)."""
        return health_response()

    if os.environ.get(DEV_MODE_ENV, "0") not in ("", "0"):
        logger.warning("%s is set: development endpoints (/reset_prefix_cache) are enabled",
                       DEV_MODE_ENV)

        @router.post("/reset_prefix_cache")
        async def reset_prefix_cache():
            """Forget every cached prefix (vLLM's dev endpoint); false while a request holds
            blocks."""
            return {"success": bool(await llm.call_utility("reset_prefix_cache"))}


# vLLM's endpoints for other model kinds (pooling, scoring, speech): a client pointed at one
# hears why, not a bare "Not Found".
UNSERVED = ("/v1/embeddings", "/pooling", "/classify", "/v1/classify", "/score", "/v1/score",
            "/rerank", "/v1/rerank", "/v2/rerank", "/v1/audio/transcriptions",
            "/v1/audio/translations", "/v1/images/generations")


def _add_unserved(router: APIRouter) -> None:
    def unserved(path: str):
        async def answer():
            return error_response(
                404, f"{path} is not served: this server generates text only (/v1/completions, "
                     "/v1/chat/completions, /v1/responses); embeddings, pooling, scoring, "
                     "reranking and audio are not implemented.", "NotFoundError")
        return answer

    for path in UNSERVED:
        router.add_api_route(path, unserved(path), methods=["POST"], include_in_schema=False,
                             name=f"unserved {path}")
