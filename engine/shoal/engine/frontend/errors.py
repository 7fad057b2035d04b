"""Errors a request can end with in the frontend, each carrying the HTTP status it maps to."""

from __future__ import annotations


class RequestError(Exception):
    """A request failed for a reason the client should see; `status` is the HTTP status."""

    status = 500
    kind = "InternalServerError"

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        if status is not None:
            self.status = status


class InvalidRequestError(RequestError, ValueError):
    """The request itself is wrong (400): the message says what to change."""

    status = 400
    kind = "BadRequestError"


class EngineUnavailableError(RequestError):
    """The engine does not take new requests right now (503): draining or stopped."""

    status = 503
    kind = "ServiceUnavailableError"


class RequestRejectedError(RequestError):
    """The engine refused the ADD; status and message come from the engine."""

    kind = "EngineRejectedError"
