"""death.death_cause: permanence is decided where the exception is known, never from its text.
A bad setting or a missing model at start-up is permanent; the same exception class after the
engine served is a transient engine error."""

from __future__ import annotations

import pytest
from shoal.contract.termination import Cause, is_permanent
from shoal.engine.core.engine_core_proc.death import death_cause
from shoal.engine.errors import ConfigError, ModelNotFoundError, UnsupportedModelError


class OutOfMemoryError(RuntimeError):  # torch's class name; torch is not needed to test it
    pass


@pytest.mark.parametrize(
    "exc, serving, cause",
    [
        (ConfigError("--max-model-len must be positive"), False, Cause.CONFIG_ERROR),
        (UnsupportedModelError("GPT2LMHeadModel: absolute position embeddings"), False,
         Cause.CONFIG_ERROR),
        (ModelNotFoundError("model path '/m' is not a directory"), False, Cause.MODEL_NOT_FOUND),
        # Text that reads like a permanent fault is not one.
        (FileNotFoundError("[Errno 2] No such file or directory: '/dev/shm/nccl-x'"), False,
         Cause.STARTUP_ERROR),
        (ValueError("max_model_len must be positive"), False, Cause.STARTUP_ERROR),
        (PermissionError("model files ['model.safetensors'] are not readable"), False,
         Cause.STARTUP_ERROR),
        # After the engine served, nothing is permanent.
        (ValueError("bad batch: must be sorted"), True, Cause.ENGINE_ERROR),
        (ConfigError("a config error raised mid-step"), True, Cause.ENGINE_ERROR),
        (ModelNotFoundError("vanished"), True, Cause.ENGINE_ERROR),
        (OutOfMemoryError("CUDA out of memory"), True, Cause.OUT_OF_MEMORY),
        (MemoryError(), False, Cause.OUT_OF_MEMORY),
    ],
)
def test_death_cause(exc, serving, cause):
    assert death_cause(exc, serving=serving) == cause
    assert is_permanent(death_cause(exc, serving=serving)) == (
        cause in (Cause.CONFIG_ERROR, Cause.MODEL_NOT_FOUND))
