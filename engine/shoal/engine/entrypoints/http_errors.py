"""OpenAI's error JSON and the status that says whose fault an error is.

`{"error": {"message", "type", "param", "code"}}`: 400 bad input (the message says what to
change), 401 wrong/missing API key, 404 unknown model (as OpenAI and vLLM answer), 503 engine
unavailable (shutting down), 500 engine death (the message names the process, rank and root
cause).
"""

from __future__ import annotations

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from shoal.engine.frontend.errors import RequestError
from shoal.engine.mp_client import EngineDeadError


def error_response(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": status}}, status_code=status)


def error_json(exc: BaseException) -> tuple[int, dict]:
    """(status, body) for an exception raised while serving a request."""
    if isinstance(exc, EngineDeadError):
        status, kind, msg = 500, "EngineDeadError", str(exc)
    elif isinstance(exc, RequestError):
        status, kind, msg = exc.status, exc.kind, str(exc)
    else:
        status, kind, msg = 500, "InternalServerError", f"{type(exc).__name__}: {exc}"
    return status, {"error": {"message": msg, "type": kind, "param": None, "code": status}}


def validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        if err.get("type") == "json_invalid":
            return "the request body is not valid JSON; send a JSON object."
        parts.append(f"{loc or 'body'}: {err.get('msg')}")
    return "invalid request: " + "; ".join(parts[:5])
