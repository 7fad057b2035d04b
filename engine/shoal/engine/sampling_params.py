"""The offline API's SamplingParams (`from shoal.engine import SamplingParams`): the wire's struct
with vLLM 0.32's construction (vllm/sampling_params.py, `__post_init__` and `_verify_args`):
values are converted and checked when the object is made, and a bad one is a ValueError with
vLLM's message, so a script that vLLM refuses is refused here at the same line.

Conversions, as vLLM: `seed=-1` is no seed; `stop` a string is that one stop string, None no
stops; `stop_token_ids` None is none, duplicates dropped; `logprobs` / `prompt_logprobs` True is
1; a temperature in (0, 0.01) is raised to 0.01 (logged: smaller ones overflow); a temperature
below 1e-5 is greedy, which resets top_p, top_k and min_p to their neutral values and needs
n = 1. The server builds the plain wire struct and checks it per request (a 400, not this).
"""

from __future__ import annotations

import logging
import math
import os

from shoal.engine import wire

logger = logging.getLogger("shoal.engine.llm")

_SAMPLING_EPS = 1e-5
_MAX_TEMP = 1e-2
MAX_N_ENV = "VLLM_MAX_N_SEQUENCES"  # vLLM's variable and default
DEFAULT_MAX_N = 16384


def _check_num_sequences(value, name: str) -> None:
    if not isinstance(value, int):
        raise ValueError(f"{name} must be an int, but is of type {type(value)}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}.")
    max_n = int(os.environ.get(MAX_N_ENV, DEFAULT_MAX_N))
    if value > max_n:
        raise ValueError(f"{name} must be at most {max_n}, got {value}. To increase this "
                         f"limit, set the {MAX_N_ENV} environment variable.")


class SamplingParams(wire.SamplingParams):
    """vLLM's SamplingParams, checked at construction (see the module docstring)."""

    def __post_init__(self) -> None:
        super().__post_init__()  # the stop lists' offline forms
        if 0 < self.temperature < _MAX_TEMP:
            logger.warning("temperature %s is less than %s, which may cause numerical errors "
                           "nan or inf in tensors. We have maxed it out to %s.",
                           self.temperature, _MAX_TEMP, _MAX_TEMP)
            self.temperature = _MAX_TEMP
        if self.seed == -1:
            self.seed = None
        self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids))
        if self.logprobs is True:
            self.logprobs = 1
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1
        self._verify_args()
        if self.temperature < _SAMPLING_EPS:  # greedy
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
            if self.n > 1:
                raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}.")

    def _verify_args(self) -> None:
        """vLLM's checks, in vLLM's order and words."""
        _check_num_sequences(self.n, "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}.")
        if not math.isfinite(self.repetition_penalty):
            raise ValueError(
                f"repetition_penalty must be a finite number, got {self.repetition_penalty}.")
        if self.repetition_penalty <= 0.0:
            raise ValueError(
                f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        if not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number, got {self.temperature}.")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if self.temperature > 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1:  # vLLM quietly accepts -1 as disabled, but prefers 0
            raise ValueError(f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")
        if not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be an integer, got {type(self.top_k).__name__}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        self._verify_lengths()
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value != -1 and value < 0:
                raise ValueError(f"{name} must be non-negative or -1, got {value}.")
        if not all(isinstance(t, int) for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must contain only integers, got {self.stop_token_ids}.")
        if any(not s for s in self.stop):
            raise ValueError("stop cannot contain an empty string.")

    def _verify_lengths(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise ValueError(
                f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be less than or equal to "
                             f"max_tokens={self.max_tokens}, got {self.min_tokens}.")
