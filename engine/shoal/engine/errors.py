"""Every error type of the engine, in one module both processes and the HTTP layer import.

Three families, by who raises them and who reads them:
- Permanence the engine knows (ConfigError and its kinds): raised at start-up by the code that
  checked (config validation, the model directory, the architecture check). A restart cannot fix
  a bad setting or a missing model; the death path (core/engine_core_proc/death.py) turns these
  classes, never an error's text, into a termination cause.
- The engine process from the frontend's side (EngineDeadError, EngineStoppedError,
  EngineStartupError): raised by the core client when the process died, stopped or never came
  up. Here rather than in the client, so the HTTP layer does not import the transport for them.
- A request's failure in the frontend (RequestError and its kinds), each with its HTTP status.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shoal.engine import wire


# ----- permanence the engine knows ------------------------------------------------------------


class ConfigError(ValueError):
    """A setting the engine refuses before it loads anything: fix the flags/spec to retry."""


class ModelNotFoundError(ConfigError):
    """The model path does not exist, or is not a Hugging Face model directory."""


class UnsupportedModelError(ConfigError):
    """The model uses an architecture or feature the engine does not implement (named)."""


# ----- the engine process, seen from the frontend -----------------------------------------------


class EngineDeadError(RuntimeError):
    """The engine process died; `dead` names the process, rank and root cause."""

    def __init__(self, dead: wire.EngineDead) -> None:
        super().__init__(f"the engine died: {dead.describe()}")
        self.dead = dead


class EngineStoppedError(RuntimeError):
    """The engine exited cleanly on request (shutdown); nothing more will come."""


class EngineStartupError(RuntimeError):
    """Start-up failed before the engine could report a root cause of its own."""


# ----- a request's failure in the frontend ------------------------------------------------------

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


class UnknownModelError(RequestError):
    """The request's `model` is neither a served name nor an adapter (404, vLLM's
    NotFoundError): the message names what is served."""

    status = 404
    kind = "NotFoundError"


class EngineUnavailableError(RequestError):
    """The engine does not take new requests right now (503): draining or stopped."""

    status = 503
    kind = "ServiceUnavailableError"


class RequestRejectedError(RequestError):
    """The engine refused the ADD; status and message come from the engine."""

    kind = "EngineRejectedError"
