"""Errors whose permanence the engine knows, and the one place a death gets its cause.

A restart cannot fix a bad setting or a missing model, so those are permanent; but only where
the engine *knows* it is one: the exception is one of these classes, raised at start-up by the
code that checked (config validation, the model directory, the architecture check). Anything
raised after the engine served is transient unless proven otherwise (a ValueError in a step is
a bug or a bad batch, not a bad spec). Nothing here reads an error's text to decide.
"""

from __future__ import annotations

from shoal.contract.termination import Cause


class ConfigError(ValueError):
    """A setting the engine refuses before it loads anything: fix the flags/spec to retry."""


class ModelNotFoundError(ConfigError):
    """The model path does not exist, or is not a Hugging Face model directory."""


class UnsupportedModelError(ConfigError):
    """The model uses an architecture or feature the engine does not implement (named)."""


# Exception class names that mean memory ran out (torch's is torch.OutOfMemoryError).
OOM_TYPES = frozenset({"MemoryError", "OutOfMemoryError"})


def death_cause(exc: BaseException, *, serving: bool) -> Cause:
    """The cause a dying engine process writes, decided where the exception object is known.

    `serving`: the engine had finished start-up (it answered its first step)."""
    if type(exc).__name__ in OOM_TYPES:
        return Cause.OUT_OF_MEMORY
    if not serving:
        if isinstance(exc, ModelNotFoundError):
            return Cause.MODEL_NOT_FOUND
        if isinstance(exc, ConfigError):
            return Cause.CONFIG_ERROR
        return Cause.STARTUP_ERROR
    return Cause.ENGINE_ERROR
