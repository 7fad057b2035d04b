"""What the proxy reads from a group's answer and from the client's connection: an SSE event's
kind (output, preamble or error), an OpenAI error body's message, how an exception and a group
are named in messages, and a client that disconnects while the proxy waits.

Pure helpers (no state), so the proxy's retry rules read as rules; tests/router checks the event
rule on real engine streams' shapes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

from fastapi import Request
from shoal.router.discovery import Group


def describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if text != type(exc).__name__ else text


def upstream_message(body: bytes) -> str:
    """The `error.message` of a group's OpenAI error JSON, else the start of its body."""
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        return str(json.loads(body)["error"]["message"])
    return body[:200].decode(errors="replace") or "(empty body)"


class Disconnected(Exception):
    pass


async def unless_disconnected(request: Request, coro):
    """`await coro`, unless the client disconnects first: then cancel it and raise
    Disconnected."""
    task = asyncio.ensure_future(coro)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    raise Disconnected


def who(group: Group) -> str:
    """How errors name a group: "engine group 1" (per-engine) or "engine prod/llm group 1"."""
    return group.name if group.engine else f"engine {group.name}"


def event_data(event: bytes) -> bytes:
    return b"".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))


def event_kind(event: bytes) -> tuple[str, int]:
    """('output' | 'preamble' | 'error', error code) of one SSE event. Output: `[DONE]`, any
    text, delta content, tool call, finish reason or usage; preamble: e.g. the chat role
    chunk; error: an OpenAI error event."""
    data = event_data(event)
    if not data or data == b"[DONE]":
        return ("output", 0) if data else ("preamble", 0)
    try:
        obj = json.loads(data)
    except ValueError:
        return "output", 0
    if not isinstance(obj, dict):
        return "output", 0
    if "error" in obj:
        err = obj["error"] if isinstance(obj["error"], dict) else {}
        code = err.get("code")
        return "error", code if isinstance(code, int) else 500
    if obj.get("usage"):
        return "output", 0
    for choice in obj.get("choices") or []:
        if not isinstance(choice, dict):
            return "output", 0
        delta = choice.get("delta") or {}
        if (choice.get("text") or choice.get("finish_reason") or delta.get("content")
                or delta.get("tool_calls") or delta.get("reasoning_content")):
            return "output", 0
    return "preamble", 0
