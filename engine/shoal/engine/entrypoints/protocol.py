"""OpenAI request bodies (pydantic) and their translation to SamplingParams.

The rule: accept what cannot change the answer, refuse what would. A field this server does
not implement is a 400 that names it, never silently ignored: every model forbids unknown
fields (`_Strict`), and http_errors.validation_error turns pydantic's `extra_forbidden` into
"unsupported field(s): ...". Accepted without effect: OpenAI's routing and bookkeeping hints
(`user`, `prompt_cache_key`, `safety_identifier`, `metadata`, `store: false`, `service_tier`),
and the fields peer routers (vllm-router, sglang-router) inject at the value that means "off"
(`no_stop_trim: false`, `return_hidden_states: false`; on chat `continue_final_message: false`,
`separate_reasoning`, `stream_reasoning`, `include_reasoning`: true): those are declared as
no-ops that accept only that value (`_only`), any other is a 400 naming it. `null` for an
optional field means absent (`_Strict`). Wrong types are a 400 naming the field as well.
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError
from shoal.engine.entrypoints.structured_request import structured_outputs_of
from shoal.engine.errors import InvalidRequestError
from shoal.engine.wire import SamplingParams

# The error type of a no-op field sent with a value that would mean something; http_errors
# reports it with the unknown fields as "unsupported field(s)".
NOT_IMPLEMENTED_VALUE = "not_implemented_value"
logger = logging.getLogger("shoal.engine.api")


def _only(*accepted: Any) -> AfterValidator:
    """A no-op field: accept only the values that mean "do nothing" here; any other is a 400."""
    shown = " or ".join(json.dumps(a) for a in accepted)

    def check(value: Any) -> Any:
        if any(value == a and type(value) is type(a) for a in accepted):
            return value
        raise PydanticCustomError(NOT_IMPLEMENTED_VALUE, "only {accepted} is accepted here",
                                  {"accepted": shown})

    return AfterValidator(check)


class _Strict(BaseModel):
    """Base of every request body: a field the server does not declare is rejected (400);
    `null` is the field's absence (vLLM's clients send `"n": null`, `"stream": null`)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if v is not None}
            _log_unknown_once(cls, data)
        return data


_LOGGED_UNKNOWN: set[tuple[str, str]] = set()


def _log_unknown_once(model: type[BaseModel], data: dict) -> None:
    """A field this server does not declare, sent with a value, is logged the first time (which
    clients send what), then refused as always (extra="forbid")."""
    known = set(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}
    for name in data.keys() - known:
        if (model.__name__, name) not in _LOGGED_UNKNOWN:
            _LOGGED_UNKNOWN.add((model.__name__, name))
            logger.warning("request field %r (%s) is not implemented: refused with a 400; "
                           "logged once", name, model.__name__)


class StreamOptions(_Strict):
    include_usage: bool = False
    # vLLM's: usage (so far) in every chunk, with include_usage (guidellm asks for it).
    continuous_usage_stats: bool = False

    def usage_flags(self) -> tuple[bool, bool]:
        """(the final usage chunk, usage in every chunk): vLLM's should_include_usage."""
        return self.include_usage, self.include_usage and self.continuous_usage_stats


def usage_flags(options: StreamOptions | None) -> tuple[bool, bool]:
    return options.usage_flags() if options is not None else (False, False)


# ----- structured output (structured_request.py reads these) ----------------------------------


class JsonSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: str  # "text", "json_object", "json_schema"; others are a 400 naming it
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Strict):
    """vLLM's `structured_outputs`; a key the server does not implement is a 400."""

    model_config = ConfigDict(populate_by_name=True)

    json_: str | dict | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


# ----- tools (tool_calls.py reads these) --------------------------------------------------------


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ChatTool(_Strict):
    type: str  # only "function"; others are a 400 naming it
    function: FunctionDefinition


class _Sampling(_Strict):

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    # No-ops: OpenAI's routing and bookkeeping hints (any value: they tag or route a request,
    # nothing is stored, one tier serves everything); an empty bias.
    user: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    metadata: dict[str, str] | None = None
    store: Annotated[bool | None, _only(None, False)] = None
    service_tier: Annotated[str | None, _only(None, "auto", "default")] = None
    logit_bias: Annotated[dict[str, float] | None, _only(None, {})] = None
    # No-ops at the value peer routers inject (SGLang's names): stop strings are trimmed, no
    # hidden states are returned.
    no_stop_trim: Annotated[bool, _only(False)] = False
    return_hidden_states: Annotated[bool, _only(False)] = False
    # vLLM's extension: each choice also carries `token_ids` (and `prompt_token_ids` when not
    # streaming), so a client can check tokens, not just text.
    return_token_ids: bool = False
    # vLLM's: logprob tokens as "token_id:{id}" (null: the server's --return-tokens-as-token-ids).
    return_tokens_as_token_ids: bool | None = None
    # Structured output (at most one; see structured_request.py).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's extension: logprobs of every prompt token after the first, with N alternatives.
    prompt_logprobs: StrictInt | None = None
    # vLLM's: the request's id (the response's id is "chatcmpl-"/"cmpl-" + it; X-Request-Id
    # wins), and keeping only N prompt tokens (-1: the most that leaves room to generate;
    # truncation_side "left", vLLM's default for generation, keeps the last N).
    request_id: str | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    # vLLM's: the request's place in the queue under --scheduling-policy priority (lower
    # first); under fcfs any value but 0 is a 400 in vLLM's words (Serving.priority).
    priority: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] = 0
    # vLLM's defaults, the only values implemented: the detokenizer puts spaces between special
    # tokens; no beam search, so no length penalty.
    spaces_between_special_tokens: Annotated[bool, _only(True)] = True
    length_penalty: Annotated[float, _only(1.0)] = 1.0

    def truncated(self, ids: list[int], max_model_len: int) -> list[int]:
        """The prompt after truncate_prompt_tokens, as vLLM's TokenizeParams truncates it."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return ids
        if keep > max_model_len:
            raise InvalidRequestError(
                f"truncate_prompt_tokens={keep} cannot be greater than max_total_tokens = "
                f"{max_model_len}. Please request a smaller truncation size.")
        if keep < 0:
            keep = max(0, max_model_len - 1)
        if keep >= len(ids):
            return ids
        return ids[:keep] if self.truncation_side == "right" else ids[len(ids) - keep:]

    def logprob_fields(self, max_logprobs: int) -> dict[str, Any]:
        """SamplingParams.logprobs / prompt_logprobs from this body; 400 naming a bad field."""
        if self.prompt_logprobs is None:
            return {}
        check_logprobs_count("prompt_logprobs", self.prompt_logprobs, max_logprobs)
        if self.stream:  # as vLLM: prompt logprobs come whole, with no stream to carry them
            raise InvalidRequestError("prompt_logprobs are not available when stream=true.")
        return {"prompt_logprobs": self.prompt_logprobs}

    def sampling_params(self, default_max_tokens: int | None, max_logprobs: int = 20,
                        defaults: dict | None = None) -> SamplingParams:
        """The engine's SamplingParams: the request's values first, then `defaults` (the model's
        generation_config: generation_config.py), then vLLM's neutral ones."""
        defaults = defaults or {}
        if not 1 <= self.n <= 16:
            raise InvalidRequestError(f"n must be between 1 and 16, got {self.n}.")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise InvalidRequestError("seed must fit in a signed 64-bit integer.")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        fields: dict[str, Any] = dict(
            n=1,  # the server fans n out into n engine requests
            max_tokens=(self.max_tokens if self.max_tokens is not None
                        else defaults.get("max_tokens", default_max_tokens)),
            seed=self.seed, stop=stop, stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if value is None:
                value = defaults.get(name)
            if value is not None:
                fields[name] = value
        fields.update(self.logprob_fields(max_logprobs))
        if fields["max_tokens"] is not None and fields["max_tokens"] < 1:
            raise InvalidRequestError(
                f"max_tokens must be at least 1, got {fields['max_tokens']}.")
        fields["structured_outputs"] = structured_outputs_of(self)
        return SamplingParams(**fields)


def check_logprobs_count(name: str, value: int, max_logprobs: int) -> None:
    if not 0 <= value <= max_logprobs:
        raise InvalidRequestError(f"{name} must be between 0 and {max_logprobs} (the server's "
                                  f"--max-logprobs), got {value}.")


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    # The prompt's text before the completion; with logprobs, the prompt tokens' logprobs too.
    echo: bool = False
    # Top-N alternatives per token, besides the sampled one (OpenAI's legacy logprobs).
    logprobs: StrictInt | None = None
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidRequestError("prompt must not be empty.")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)

    def logprob_fields(self, max_logprobs: int) -> dict[str, Any]:
        fields = super().logprob_fields(max_logprobs)
        if self.logprobs is not None:
            check_logprobs_count("logprobs", self.logprobs, max_logprobs)
            fields["logprobs"] = self.logprobs
            if self.echo and self.prompt_logprobs is None:  # vLLM: echoed tokens carry theirs
                fields["prompt_logprobs"] = self.logprobs
        return fields

    def check_supported(self) -> None:
        if self.suffix:
            raise InvalidRequestError("suffix is not supported by this server.")
        if self.best_of not in (None, 1, self.n):
            raise InvalidRequestError("best_of is not supported (only best_of == n).")


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    # Tool use in the history: an assistant's calls, and a tool's answer to one of them.
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    # A replayed assistant turn: its reasoning (vLLM 0.32's `reasoning`, or the older
    # `reasoning_content`) reaches the template under both names, as vLLM passes it (Qwen3's
    # template reads reasoning_content); a refusal is OpenAI's bookkeeping, not rendered.
    reasoning: str | None = None
    reasoning_content: str | None = None
    refusal: str | None = None

    @field_validator("reasoning", "reasoning_content", "refusal")
    @classmethod
    def _assistant_only(cls, value: Any, info: ValidationInfo) -> Any:
        if info.data.get("role") != "assistant":
            raise PydanticCustomError(NOT_IMPLEMENTED_VALUE, "only on assistant messages")
        return value

    def template_dict(self) -> dict:
        """The message as the chat template gets it (tool fields only when set)."""
        msg: dict = {"role": self.role, "content": self.text()}
        for key in ("tool_calls", "tool_call_id", "name"):
            if getattr(self, key) is not None:
                msg[key] = getattr(self, key)
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        if self.role == "assistant" and reasoning is not None:
            msg["reasoning"] = msg["reasoning_content"] = reasoning
        return msg

    def text(self) -> str:
        """Text parts joined with a newline, as vLLM joins them."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    # OpenAI's chat logprobs: the sampled tokens' logprobs, with top_logprobs alternatives each.
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: bool = True
    # No-ops at the values peer routers inject (vLLM's and SGLang's names): the last message is
    # not continued, and there is no reasoning parser whose output they would split or hide.
    continue_final_message: Annotated[bool, _only(False)] = False
    separate_reasoning: Annotated[bool, _only(True)] = True
    stream_reasoning: Annotated[bool, _only(True)] = True
    include_reasoning: Annotated[bool, _only(True)] = True
    # Extra variables for the chat template (Qwen3's enable_thinking); reasoning_effort reaches
    # it too, and sets enable_thinking (false for "none") unless the kwargs say, as vLLM does.
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh",
                              "max"] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None

    def logprob_fields(self, max_logprobs: int) -> dict[str, Any]:
        fields = super().logprob_fields(max_logprobs)
        if self.top_logprobs is not None:
            check_logprobs_count("top_logprobs", self.top_logprobs, max_logprobs)
            if self.top_logprobs > 0 and not self.logprobs:  # 0 is harmless, as in vLLM
                raise InvalidRequestError("top_logprobs requires logprobs to be true.")
        if self.logprobs:
            fields["logprobs"] = self.top_logprobs or 0
        return fields

    def check_supported(self) -> None:
        if self.max_completion_tokens is not None:  # it wins over max_tokens, as in vLLM
            self.max_tokens = self.max_completion_tokens

    def template_kwargs(self) -> dict[str, Any]:
        """What the chat template gets besides messages and tools (vLLM's build_chat_params);
        `chat_template` and `tokenize` are not template variables (400, as vLLM)."""
        kwargs = dict(self.chat_template_kwargs or {})
        if bad := sorted({"chat_template", "tokenize"} & kwargs.keys()):
            raise InvalidRequestError(
                f"Found unexpected chat template kwargs from request: {bad}")
        if self.reasoning_effort is not None:
            kwargs.setdefault("enable_thinking", self.reasoning_effort != "none")
            kwargs["reasoning_effort"] = self.reasoning_effort
        return kwargs


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # vLLM's defaults: true for a prompt; for messages false (the chat template places the
    # special tokens), true adds the tokenizer's own (BOS) on top.
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    # vllm-router sends it (false) with every chat it tokenizes; true would leave the last
    # message open, which Shoal's chat does not do either: refused, named.
    continue_final_message: Annotated[bool, _only(False)] = False

    def special_tokens(self) -> bool:
        if self.add_special_tokens is not None:
            return self.add_special_tokens
        return self.messages is None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]
