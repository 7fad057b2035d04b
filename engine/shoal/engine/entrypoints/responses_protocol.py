"""POST /v1/responses bodies (OpenAI's Responses API, stateless) and their translation into the
chat request the chat endpoint answers (serving_responses.py turns its answer back).

Stateless: nothing is stored, so `store: true`, `previous_response_id`, `conversation` and
`background: true` are refused with a 400 that says so (OpenAI's `store` defaults to true; a
client of this server sends `store: false`, as vLLM asks without a response store). Text input
and output, function tools, reasoning (with --reasoning-parser), text.format as
response_format. Unknown fields are a 400 naming them, as everywhere (protocol._Strict).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field
from shoal.engine.entrypoints.protocol import _only, _Strict
from shoal.engine.errors import InvalidRequestError

STATELESS = ("this server keeps no responses (stateless /v1/responses): send store: false "
             "and the whole conversation in `input`")


class InputText(_Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list | None = None
    logprobs: list | None = None


class InputMessage(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutput(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


class ReasoningItem(_Strict):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict] = []
    content: list[dict] | None = None
    encrypted_content: Annotated[str | None, _only(None)] = None
    status: str | None = None

    def text(self) -> str:
        return "".join(part.get("text", "") for part in self.content or self.summary)


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Annotated[str | None, _only(None, "medium")] = None


class ReasoningConfig(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Annotated[str | None, _only(None, "auto")] = None


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[Annotated[InputMessage | FunctionCallItem | FunctionCallOutput
                                | ReasoningItem, Field(union_mode="left_to_right")]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    service_tier: Annotated[str | None, _only(None, "auto", "default")] = None
    truncation: Annotated[str | None, _only(None, "disabled")] = None
    include: list[str] | None = None
    request_id: str | None = None
    priority: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] = 0  # vLLM's, as on chat
    # Stateful fields: refused with STATELESS (check_stateless), not as unknown.
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None

    def check_stateless(self) -> None:
        if self.store or self.background:  # absent: nothing is kept, as vLLM without a store
            raise InvalidRequestError(f"store: true / background: true: {STATELESS}.")
        if self.previous_response_id is not None or self.conversation is not None:
            raise InvalidRequestError(f"previous_response_id / conversation: {STATELESS}.")

    def messages(self) -> list[dict]:
        """The conversation as chat messages: instructions first, function calls as the
        assistant's tool_calls, their outputs as tool messages, reasoning replayed."""
        out: list[dict] = []
        if self.instructions:
            out.append({"role": "system", "content": self.instructions})
        items = [InputMessage(role="user", content=self.input)] if isinstance(
            self.input, str) else self.input
        reasoning = None
        for item in items:
            if isinstance(item, ReasoningItem):
                reasoning = item.text()
            elif isinstance(item, InputMessage):
                out.append({"role": item.role, "content": item.text()})
                if item.role == "assistant" and reasoning is not None:
                    out[-1]["reasoning"], reasoning = reasoning, None
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = out[-1] if out else None
                if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                    last["tool_calls"].append(call)
                else:
                    out.append({"role": "assistant", "content": "", "tool_calls": [call]})
                    if reasoning is not None:
                        out[-1]["reasoning"], reasoning = reasoning, None
            else:
                out.append({"role": "tool", "tool_call_id": item.call_id,
                            "content": item.output})
        return out

    def chat_body(self) -> dict:
        """The chat completions body that asks the same of the engine."""
        self.check_stateless()
        body: dict[str, Any] = {"messages": self.messages(), "stream": self.stream}
        for name in ("model", "temperature", "top_p", "parallel_tool_calls", "user",
                     "metadata", "prompt_cache_key", "safety_identifier", "request_id",
                     "priority"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.max_output_tokens is not None:
            body["max_tokens"] = self.max_output_tokens
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(
                exclude={"type"}, exclude_none=True)} for t in self.tools]
        if isinstance(self.tool_choice, dict):
            if self.tool_choice.get("type") != "function" or "name" not in self.tool_choice:
                raise InvalidRequestError("tool_choice: only \"auto\", \"none\", \"required\" "
                                          "or {\"type\": \"function\", \"name\": ...}.")
            body["tool_choice"] = {"type": "function",
                                   "function": {"name": self.tool_choice["name"]}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type == "json_schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}}
        elif fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        if self.reasoning is not None and self.reasoning.effort is not None:
            body["reasoning_effort"] = self.reasoning.effort
        return body
