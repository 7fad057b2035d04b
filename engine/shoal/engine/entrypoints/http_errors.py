"""OpenAI's error JSON and the status that says whose fault an error is.

`{"error": {"message", "type", "param", "code"}}`: 400 bad input (the message says what to
change), 401 wrong/missing API key, 404 unknown model (as OpenAI and vLLM answer), 503 engine
unavailable (draining or shutting down; with `Retry-After: 1`), 500 engine death (the message names the process, rank and root
cause).
"""

from __future__ import annotations

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from shoal.engine.entrypoints.protocol import NOT_IMPLEMENTED_VALUE
from shoal.engine.frontend.errors import RequestError
from shoal.engine.mp_client import EngineDeadError


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
