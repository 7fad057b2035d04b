"""POST /v1/responses (OpenAI's Responses API, stateless): the body becomes a chat request
(responses_protocol.py), the chat endpoint answers it (template, tools, reasoning, grammar and
errors are the chat endpoint's), and its answer becomes a Response: `output` items of type
"reasoning", "message" (output_text) and "function_call". Streamed, the chat chunks become the
Responses events vLLM sends (`event: TYPE` + `data: JSON`, each with a sequence_number):
response.created, response.in_progress, per item output_item.added / content_part.added /
*.delta / *.done / output_item.done, then response.completed (or "incomplete" when cut by
max_output_tokens)."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from shoal.engine.entrypoints.http_errors import GENERATION_ERRORS, error_responses
from shoal.engine.entrypoints.protocol import ChatCompletionRequest
from shoal.engine.entrypoints.responses_protocol import ResponsesRequest
from shoal.engine.entrypoints.serving import Serving


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def responses_router(s: Serving) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/responses", responses=error_responses(*GENERATION_ERRORS))
    async def responses(body: ResponsesRequest, request: Request):
        try:
            chat = ChatCompletionRequest.model_validate(body.chat_body())
        except ValidationError as exc:
            raise RequestValidationError(exc.errors()) from None
        _, endpoint = s.endpoints["chat"]
        request.state.prompt_tokens_details = True  # input_tokens_details, always (vLLM)
        answer = await endpoint(chat, request)
        head = _head(body, s.model_name)
        if not body.stream:
            if answer.status_code != 200:
                return answer
            return JSONResponse(_from_chat(json.loads(answer.body), head))
        return StreamingResponse(_events(answer.body_iterator, head),
                                 media_type="text/event-stream")

    return router


def _head(body: ResponsesRequest, model: str) -> dict:
    """The Response's fields that echo the request."""
    tc = body.tool_choice if body.tool_choice is not None else "auto"
    return {"id": _id("resp"), "object": "response", "created_at": int(time.time()),
            "model": model, "status": "in_progress", "output": [], "error": None,
            "incomplete_details": None, "instructions": body.instructions,
            "metadata": body.metadata, "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p,
            "parallel_tool_calls": body.parallel_tool_calls is not False, "tool_choice": tc,
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "previous_response_id": None, "store": False, "background": False,
            "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)
                     if body.text and body.text.format else {"type": "text"}},
            "reasoning": ({"effort": body.reasoning.effort, "summary": None}
                          if body.reasoning else None),
            "truncation": "disabled", "user": body.user, "usage": None}


def _usage(u: dict | None) -> dict | None:
    if u is None:
        return None
    return {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
            "total_tokens": u["total_tokens"], "input_tokens_details": {
                "cached_tokens": u.get("prompt_tokens_details", {}).get("cached_tokens", 0)},
            "output_tokens_details": {"reasoning_tokens": 0}}


def _finished(head: dict, output: list, finish: str | None, usage: dict | None) -> dict:
    cut = finish == "length"
    return {**head, "output": output, "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "usage": _usage(usage)}


def _reasoning_item(text: str, item_id: str | None = None) -> dict:
    return {"type": "reasoning", "id": item_id or _id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(text: str, item_id: str | None = None) -> dict:
    return {"type": "message", "id": item_id or _id("msg"), "role": "assistant",
            "status": "completed", "content": [_text_part(text)] if text else []}


def _call_item(call_id: str, name: str, arguments: str, item_id: str | None = None) -> dict:
    return {"type": "function_call", "id": item_id or _id("fc"), "call_id": call_id,
            "name": name, "arguments": arguments, "status": "completed"}


def _from_chat(chat: dict, head: dict) -> dict:
    choice = chat["choices"][0]
    message = choice["message"]
    output = []
    if message.get("reasoning"):
        output.append(_reasoning_item(message["reasoning"]))
    if message.get("content"):
        output.append(_message_item(message["content"]))
    for call in message.get("tool_calls") or []:
        output.append(_call_item(call["id"], call["function"]["name"],
                                 call["function"]["arguments"]))
    return _finished(head, output, choice["finish_reason"], chat.get("usage"))


@dataclass
class _EventStream:
    """The Responses events of one streamed answer, item by item (one item open at a time)."""

    head: dict
    seq: int = 0
    output: list = field(default_factory=list)
    kind: str | None = None  # the open item: "reasoning", "message", "call"
    item: dict = field(default_factory=dict)
    text: str = ""

    def event(self, kind: str, **fields) -> bytes:
        obj = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(obj)}\n\n".encode()

    def where(self) -> dict:
        return {"output_index": len(self.output), "item_id": self.item["id"]}

    def open(self, kind: str, item: dict) -> list[bytes]:
        out = self.close()
        self.kind, self.item, self.text = kind, item, ""
        out.append(self.event("response.output_item.added", output_index=len(self.output),
                              item={**item, "status": "in_progress"}))
        if kind == "message":
            out.append(self.event("response.content_part.added", **self.where(),
                                  content_index=0, part=_text_part("")))
        elif kind == "reasoning":
            out.append(self.event("response.content_part.added", **self.where(),
                                  content_index=0, part={"type": "reasoning_text", "text": ""}))
        return out

    def delta(self, kind: str, text: str) -> list[bytes]:
        out = []
        if kind == "message" and self.kind != "message":
            out = self.open("message", {**_message_item("", _id("msg")), "content": []})
        elif kind == "reasoning" and self.kind != "reasoning":
            out = self.open("reasoning", {**_reasoning_item("", _id("rs")), "content": []})
        self.text += text
        name = {"message": "response.output_text.delta", "reasoning":
                "response.reasoning_text.delta"}[kind]
        extra = {"logprobs": []} if kind == "message" else {}
        out.append(self.event(name, **self.where(), content_index=0, delta=text, **extra))
        return out

    def call(self, call: dict) -> list[bytes]:
        fn = call.get("function") or {}
        out = []
        if "name" in fn:  # a new call
            out = self.open("call", _call_item(call["id"], fn["name"], "", _id("fc")))
        if fn.get("arguments"):
            self.text += fn["arguments"]
            out.append(self.event("response.function_call_arguments.delta", **self.where(),
                                  delta=fn["arguments"]))
        return out

    def close(self) -> list[bytes]:
        if self.kind is None:
            return []
        where, text, item = self.where(), self.text, self.item
        if self.kind == "message":
            done = _message_item(text, item["id"])
            out = [self.event("response.output_text.done", **where, content_index=0, text=text,
                              logprobs=[]),
                   self.event("response.content_part.done", **where, content_index=0,
                              part=_text_part(text))]
        elif self.kind == "reasoning":
            done = _reasoning_item(text, item["id"])
            out = [self.event("response.reasoning_text.done", **where, content_index=0,
                              text=text),
                   self.event("response.content_part.done", **where, content_index=0,
                              part={"type": "reasoning_text", "text": text})]
        else:
            done = _call_item(item["call_id"], item["name"], text, item["id"])
            out = [self.event("response.function_call_arguments.done", **where,
                              arguments=text, name=item["name"])]
        out.append(self.event("response.output_item.done", output_index=where["output_index"],
                              item=done))
        self.output.append(done)
        self.kind = None
        return out


async def _events(chunks, head: dict):
    """The chat endpoint's SSE chunks -> the Responses events."""
    st = _EventStream(head)
    yield st.event("response.created", response=head)
    yield st.event("response.in_progress", response=head)
    finish, usage, buffer = None, None, b""
    async for raw in chunks:
        buffer += raw if isinstance(raw, bytes) else raw.encode()
        while b"\n\n" in buffer:
            frame, buffer = buffer.split(b"\n\n", 1)
            if not frame.startswith(b"data: {"):
                continue
            chunk = json.loads(frame[6:])
            if "error" in chunk:
                err = chunk["error"]
                for out in st.close():
                    yield out
                yield st.event("error", code=err.get("type"), message=err.get("message"),
                               param=err.get("param"))
                yield st.event("response.failed", response={
                    **head, "status": "failed", "output": st.output,
                    "error": {"code": "server_error", "message": err.get("message")}})
                return
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                for key, kind in (("reasoning", "reasoning"), ("content", "message")):
                    if delta.get(key) and "role" not in delta:
                        for out in st.delta(kind, delta[key]):
                            yield out
                for call in delta.get("tool_calls") or []:
                    for out in st.call(call):
                        yield out
                finish = choice.get("finish_reason") or finish
    for out in st.close():
        yield out
    yield st.event("response.completed", response=_finished(head, st.output, finish, usage))
