"""OpenAI's error JSON and the status that says whose fault an error is.

`{"error": {"message", "type", "param", "code"}}`: 400 bad input (the message says what to
change), 401 wrong/missing API key, 404 unknown model (as OpenAI and vLLM answer), 503 engine
unavailable (draining or shutting down; with `Retry-After: 1`), 500 engine death (the message
names the process, rank and root cause).
"""

from __future__ import annotations

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from shoal.engine.entrypoints.protocol import NOT_IMPLEMENTED_VALUE
from shoal.engine.errors import EngineDeadError, RequestError


class ErrorDetail(BaseModel):
    message: str  # what went wrong and what to change
    type: str  # e.g. BadRequestError, NotFoundError, ServiceUnavailableError
    param: str | None = None  # the offending request field, when one is to blame
    code: int  # the HTTP status again


class ErrorResponse(BaseModel):
    """OpenAI's error body, the model of every documented error response."""

    error: ErrorDetail


_WHEN = {
    400: "The request is invalid or uses a field this server does not implement; the message "
         "says what to change.",
    401: "Missing or wrong API key (only when the server runs with --api-key).",
    404: "The model named in the request is not served here.",
    500: "The engine died; the message names the process, rank and root cause.",
    503: "The server is draining or shutting down and admits no new requests; retry after "
         "Retry-After seconds (on another replica).",
}
_RETRY_AFTER_HEADER = {"Retry-After": {"description": "Seconds to wait before retrying.",
                                       "schema": {"type": "integer"}}}
# What each endpoint group can answer besides its 200 (the route decorators' `responses=`).
GENERATION_ERRORS = (400, 401, 404, 500, 503)
TOKENIZER_ERRORS = (400, 404)


ERROR_SCHEMA_REF = "#/components/schemas/ErrorResponse"


def error_responses(*codes: int) -> dict[int | str, dict]:
    """OpenAPI `responses=` for these error statuses, each OpenAI's error JSON.

    The content is named explicitly as application/json (not via `model=`, which FastAPI files
    under the route's own media type: /health's 200 is text/plain); build_app adds the
    ErrorResponse schema to the document's components."""
    content = {"application/json": {"schema": {"$ref": ERROR_SCHEMA_REF}}}
    out: dict[int | str, dict] = {}
    for code in codes:
        out[code] = {"description": _WHEN[code], "content": content}
        if code == 503:
            out[code]["headers"] = _RETRY_AFTER_HEADER
    return out


def add_error_schema(schema: dict) -> None:
    """Put ErrorResponse (and the models it uses) into an OpenAPI document's components."""
    model = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.update(model.pop("$defs", {}))
    components["ErrorResponse"] = model


def error_response(status: int, message: str, kind: str, param: str | None = None,
                   retry_after: int | None = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": status}}, status_code=status, headers=headers)


def exception_response(exc: BaseException) -> JSONResponse:
    """The JSON error answer for an exception raised before a response started; a 503 that
    means "come back later" carries Retry-After."""
    status, body = error_json(exc)
    retry_after = exc.retry_after if isinstance(exc, RequestError) else None
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(body, status_code=status, headers=headers)


def error_json(exc: BaseException) -> tuple[int, dict]:
    """(status, body) for an exception raised while serving a request."""
    if isinstance(exc, EngineDeadError):
        status, kind, msg = 500, "EngineDeadError", str(exc)
    elif isinstance(exc, RequestError):
        status, kind, msg = exc.status, exc.kind, str(exc)
    else:
        status, kind, msg = 500, "InternalServerError", f"{type(exc).__name__}: {exc}"
    return status, {"error": {"message": msg, "type": kind, "param": None, "code": status}}


def validation_error(exc: RequestValidationError) -> tuple[str, str | None]:
    """(message, param) of the 400 for a body that failed validation.

    Fields the server does not implement (unknown ones, and declared no-ops sent with a value
    that would mean something) come first, named together: the client learns at once what to
    drop. `param` names the first offending field, as OpenAI's errors do."""
    unsupported, parts = [], []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        kind = err.get("type")
        if kind == "json_invalid":
            return "the request body is not valid JSON; send a JSON object.", None
        if kind == "extra_forbidden":
            unsupported.append(loc)
        elif kind == NOT_IMPLEMENTED_VALUE:
            unsupported.append(f"{loc} ({err.get('msg')})")
        else:
            parts.append((loc, f"{loc or 'body'}: {err.get('msg')}"))
    if unsupported:
        return (f"unsupported field(s): {', '.join(unsupported)}; this server does not "
                "implement them, remove them from the request.",
                unsupported[0].split(" ")[0])
    return "invalid request: " + "; ".join(p for _, p in parts[:5]), parts[0][0] or None
