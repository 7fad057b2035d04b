"""POST /invocations: SageMaker's one inference route, as vLLM serves it: the body is a chat
request when it has `messages`, a completions request when it has `prompt`, and is answered by
that endpoint (streaming included). Not under /v1, so not behind --api-key (as in vLLM)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from shoal.engine.entrypoints.http_errors import GENERATION_ERRORS, error_responses
from shoal.engine.entrypoints.serving import Serving
from shoal.engine.errors import InvalidRequestError


def invocations_router(s: Serving) -> APIRouter:
    router = APIRouter()

    @router.post("/invocations",
                 responses=error_responses(*(c for c in GENERATION_ERRORS if c != 401)))
    async def invocations(request: Request):
        try:
            body = await request.json()
        except ValueError:
            raise InvalidRequestError("the body is not valid JSON.") from None
        kind = ("chat" if isinstance(body, dict) and "messages" in body
                else "completion" if isinstance(body, dict) and "prompt" in body else None)
        if kind is None:
            raise InvalidRequestError("an /invocations body is a chat request (`messages`) or "
                                      "a completions request (`prompt`).")
        model, endpoint = s.endpoints[kind]
        try:
            parsed = model.model_validate(body)
        except ValidationError as exc:
            raise RequestValidationError(exc.errors()) from None
        return await endpoint(parsed, request)

    return router
