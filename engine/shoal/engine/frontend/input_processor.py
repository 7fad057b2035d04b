"""InputProcessor: prompt (text, token ids or chat messages) -> EngineCoreRequest.

The only prompt tokenizer in the system: token ids cross the wire, never strings. It validates
everything the engine would refuse, against the limits the engine reported after KV sizing
(EngineReady), so a bad request fails here with a 400 that says what to change and never costs
an engine round trip.
"""

from __future__ import annotations

import secrets
import time

from shoal.engine.core.request_queue import PRIORITY, priority_refusal
from shoal.engine.errors import InvalidRequestError
from shoal.engine.wire import EngineCoreRequest, LoRARequest, SamplingParams


class InputProcessor:
    def __init__(self, tokenizer, *, max_model_len: int, vocab_size: int,
                 extra_eos_token_ids: list[int] | None = None,
                 scheduling_policy: str = "fcfs") -> None:
        self.tokenizer = tokenizer
        self.scheduling_policy = scheduling_policy  # a priority other than 0 needs "priority"
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        # generation_config's other end tokens (e.g. <|im_end|>): stop like EOS, as vLLM does.
        self.extra_eos_token_ids = [t for t in (extra_eos_token_ids or [])
                                    if t != tokenizer.eos_token_id]

    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None,
                    add_special_tokens: bool = False,
                    template_kwargs: dict | None = None) -> list[int]:
        """The chat template's tokens; `add_special_tokens` adds the tokenizer's own (BOS) on
        top of what the template writes (vLLM's /tokenize and chat field); `template_kwargs`:
        the request's further template variables (chat_template_kwargs, reasoning_effort)."""
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or not isinstance(m.get("content"), str):
                raise InvalidRequestError(
                    f"messages[{i}] must be an object with a 'role' and a string 'content'.")
        try:
            ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt,
                tokenize=not add_special_tokens, **({"tools": tools} if tools else {}),
                **{k: v for k, v in (template_kwargs or {}).items()
                   if k not in ("messages", "add_generation_prompt", "tools")})
        except Exception as exc:  # noqa: BLE001 - template errors are the caller's input
            raise InvalidRequestError(f"could not apply the chat template: {exc}") from None
        if add_special_tokens:
            return self.tokenize(ids, add_special_tokens=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    @staticmethod
    def engine_request_id(external_id: str) -> str:
        """The engine-side id: the caller's id plus a random suffix, unique even if callers
        reuse ids."""
        return f"{external_id}-{secrets.token_hex(4)}"

    def process(self, request_id: str, prompt_token_ids: list[int],
                params: SamplingParams, priority: int = 0,
                lora_request: LoRARequest | None = None) -> EngineCoreRequest:
        """Validate and build the request. `params` is completed in place (max_tokens, stop
        token ids) so the caller sees what was actually asked of the engine."""
        if priority != 0 and self.scheduling_policy != PRIORITY:
            raise InvalidRequestError(priority_refusal(priority))
        n_prompt = len(prompt_token_ids)
        if n_prompt == 0:
            raise InvalidRequestError("the prompt is empty; send at least one token.")
        bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
        if bad:
            raise InvalidRequestError(f"prompt token ids {bad[:5]} are outside the vocabulary "
                                      f"[0, {self.vocab_size}).")
        if n_prompt >= self.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt has {n_prompt} tokens, which leaves no room to generate. Shorten "
                f"the prompt to at most {self.max_model_len - 1} tokens.")
        if params.max_tokens is None:
            params.max_tokens = self.max_model_len - n_prompt
        elif n_prompt + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {n_prompt + params.max_tokens} tokens ({n_prompt} in the prompt, "
                f"{params.max_tokens} in the completion). Reduce the prompt or max_tokens.")
        try:
            params.verify()
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        if not params.ignore_eos and self.extra_eos_token_ids:
            params.stop_token_ids = list(dict.fromkeys(
                [*params.stop_token_ids, *self.extra_eos_token_ids]))
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            arrival_time=time.time(),
            eos_token_id=self.tokenizer.eos_token_id,
            priority=priority,
            lora_request=lora_request,
        )
