"""The OpenAI-compatible HTTP app (FastAPI) on top of one AsyncLLM: error handlers, the API key,
and the endpoint groups (one module each: serving_completions, serving_chat, serving_admin).

Responses and SSE chunks follow OpenAI's (and vLLM's) shapes. Every error is OpenAI's error JSON
(http_errors.py). A stream that already sent 200 ends with an error event and `data: [DONE]`.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from shoal.engine import __version__
from shoal.engine.entrypoints.http_errors import error_json, error_response, validation_message
from shoal.engine.entrypoints.serving import Serving
from shoal.engine.entrypoints.serving_admin import admin_router
from shoal.engine.entrypoints.serving_chat import chat_router
from shoal.engine.entrypoints.serving_completions import completions_router
from shoal.engine.entrypoints.tool_calls import ToolSettings
from shoal.engine.frontend.async_llm import AsyncLLM
from shoal.engine.frontend.errors import RequestError
from shoal.engine.mp_client import EngineDeadError
from starlette.exceptions import HTTPException as StarletteHTTPException


def build_app(llm: AsyncLLM, *, served_model_names: list[str], api_key: str | None = None,
              tool_settings: ToolSettings | None = None) -> FastAPI:
    app = FastAPI(title="shoal", version=__version__, docs_url=None, redoc_url=None)
    app.state.llm = llm

    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, exc: RequestValidationError):
        return error_response(400, validation_message(exc), "BadRequestError")

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(request: Request, exc: StarletteHTTPException):
        kind = {404: "NotFoundError", 405: "MethodNotAllowedError"}.get(exc.status_code, "Error")
        return error_response(exc.status_code, str(exc.detail), kind)

    @app.exception_handler(RequestError)
    @app.exception_handler(EngineDeadError)
    async def _on_request_error(request: Request, exc: Exception):
        status, body = error_json(exc)
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

    serving = Serving(llm, served_model_names)
    for router in (completions_router(serving), chat_router(serving, tool_settings),
                   admin_router(serving)):
        app.include_router(router)
    return app
