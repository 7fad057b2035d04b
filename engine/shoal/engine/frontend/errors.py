"""Errors a request can end with in the frontend, each carrying the HTTP status it maps to."""

from __future__ import annotations

# Retry-After (seconds) on every 503 that means "come back later" (draining, shutting down).
# One second: by then the readiness probe (which sees /health's 503 at once) has taken this
# replica out of the Service, so a retry through it lands on another replica; a client talking
# to this replica alone keeps getting 503 until a new one answers, and retries that cheaply.
RETRY_AFTER_S = 1


class RequestError(Exception):
    """A request failed for a reason the client should see; `status` is the HTTP status."""

    status = 500
    kind = "InternalServerError"

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        if status is not None:
            self.status = status

    @property
    def retry_after(self) -> int | None:
        """Seconds the client should wait before retrying; set on every 503 (see above)."""
        return RETRY_AFTER_S if self.status == 503 else None


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
