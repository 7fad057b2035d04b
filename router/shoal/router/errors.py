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


def unknown_model(model, available) -> JSONResponse:
    """OpenAI's 404 for a model no group serves, naming the ones that are served."""
    names = ", ".join(sorted(available)) or "none (no InferenceEngine has a ready group)"
    return error_response(404, f"The model `{model}` does not exist. Available models: "
                               f"{names}.", "NotFoundError")
