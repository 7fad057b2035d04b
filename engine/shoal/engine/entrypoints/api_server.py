"""The OpenAI-compatible HTTP app (FastAPI) on top of one AsyncLLM: error handlers, the API key
(api_key.py) and the endpoint groups (one module each: serving_completions, serving_chat,
serving_admin).

Responses and SSE chunks follow OpenAI's (and vLLM's) shapes. Every error is OpenAI's error JSON
(http_errors.py). A stream that already sent 200 ends with an error event and `data: [DONE]`.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from shoal.engine import __version__
from shoal.engine.entrypoints import http_metrics, serving_lora
from shoal.engine.entrypoints.api_key import ApiKeyAuth
from shoal.engine.entrypoints.http_errors import (
    add_error_schema,
    error_response,
    exception_response,
    validation_error,
)
from shoal.engine.entrypoints.serving import OutputSettings, Serving
from shoal.engine.entrypoints.serving_admin import admin_router
from shoal.engine.entrypoints.serving_chat import chat_router
from shoal.engine.entrypoints.serving_completions import completions_router
from shoal.engine.entrypoints.serving_invocations import invocations_router
from shoal.engine.entrypoints.tool_calls import ToolSettings
from shoal.engine.errors import EngineDeadError, RequestError
from shoal.engine.frontend.async_llm import AsyncLLM
from shoal.engine.lora.config import LoRARegistry
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send


@dataclass(frozen=True)
class HttpSettings:
    """vLLM's HTTP middleware flags: CORS (none without origins) and X-Request-Id."""

    allowed_origins: list[str] = field(default_factory=list)
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    request_id_headers: bool = False

    @classmethod
    def from_args(cls, args) -> HttpSettings:
        return cls(args.allowed_origins, args.allowed_methods, args.allowed_headers,
                   args.allow_credentials, args.enable_request_id_headers)


class RequestIdHeader:
    """--enable-request-id-headers: every response carries X-Request-Id, the request's own
    header when it sent one, else a new id (vLLM's XRequestIdMiddleware)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        sent = dict(scope.get("headers") or []).get(b"x-request-id")
        request_id = sent or uuid.uuid4().hex.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id)]
            await send(message)

        await self.app(scope, receive, send_with_id)


def build_app(llm: AsyncLLM, *, served_model_names: list[str],
              api_keys: list[str] | None = None, tool_settings: ToolSettings | None = None,
              sampling_defaults: dict | None = None, http: HttpSettings | None = None,
              output: OutputSettings | None = None,
              loras: LoRARegistry | None = None) -> FastAPI:
    """`api_keys`: the keys /v1 accepts (none: no authentication); `sampling_defaults`: the
    model's generation_config sampling values (generation_config.py), below a request's own;
    `http`: CORS and request-id headers (outermost, so a preflight needs no key); `output`:
    vLLM's flags on the shape of answers; `loras`: --enable-lora's adapters by name (the
    runtime load/unload endpoints with VLLM_ALLOW_RUNTIME_LORA_UPDATING)."""
    app = FastAPI(title="shoal", version=__version__, docs_url=None, redoc_url=None)
    app.state.llm = llm

    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, exc: RequestValidationError):
        message, param = validation_error(exc)
        return error_response(400, message, "BadRequestError", param)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(request: Request, exc: StarletteHTTPException):
        kind = {404: "NotFoundError", 405: "MethodNotAllowedError"}.get(exc.status_code, "Error")
        return error_response(exc.status_code, str(exc.detail), kind)

    @app.exception_handler(RequestError)
    @app.exception_handler(EngineDeadError)
    async def _on_request_error(request: Request, exc: Exception):
        return exception_response(exc)

    if api_keys:
        app.add_middleware(ApiKeyAuth, api_keys=api_keys)
    http = http or HttpSettings()
    if http.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=http.allowed_origins,
                           allow_credentials=http.allow_credentials,
                           allow_methods=http.allowed_methods, allow_headers=http.allowed_headers)
    if http.request_id_headers:
        app.add_middleware(RequestIdHeader)

    serving = Serving(llm, served_model_names, dict(sampling_defaults or {}),
                      output=output or OutputSettings(), http_metrics=http_metrics.instrument(app),
                      loras=loras)
    for router in (completions_router(serving), chat_router(serving, tool_settings),
                   admin_router(serving), invocations_router(serving)):
        app.include_router(router)
    if serving_lora.runtime_updates_allowed():
        app.include_router(serving_lora.lora_router(serving))
    _document_errors(app)
    return app


def _document_errors(app: FastAPI) -> None:
    """GET /openapi.json with OpenAI's error schema, and without FastAPI's automatic 422: a body
    that fails validation is answered 400 (above); each route documents its own errors."""
    generate = app.openapi

    def openapi() -> dict:
        schema = generate()
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        add_error_schema(schema)
        return schema

    app.openapi = openapi
