"""OpenAI's error JSON for the errors the router itself produces (upstream errors are passed
through unchanged)."""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse


def error_body(status: int, message: str, kind: str) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def error_response(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse(error_body(status, message, kind), status_code=status)


def sse_error(status: int, message: str, kind: str) -> bytes:
    """The in-band error event of a stream whose 200 headers are already sent."""
    return b"data: " + json.dumps(error_body(status, message, kind)).encode() + b"\n\n"


def no_group_message(why: str) -> str:
    return f"no engine group is ready: {why}"
