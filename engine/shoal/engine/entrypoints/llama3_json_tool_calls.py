"""`--tool-call-parser llama3_json` (Llama 3.1-3.3 and 4 JSON calls): the model answers
`{"name": "f", "parameters": {...}}` (or `"arguments"`), several separated by `; `, after an
optional `<|python_tag|>`, read as vLLM 0.32's Llama3JsonToolParser reads them.

Whole (`parse_whole`): each top-level JSON object of the output (decoded from every `{` past
the end of the previous object) with a `name` and `arguments` / `parameters` is a call, and
content is null; one object that does not decode or lacks those keys makes the whole output
content with no calls, as vLLM answers it.

Streamed (`Llama3JsonStream`), vLLM's state machine step for step: an output that starts with
neither `<|python_tag|>` nor `{` is content as it comes; otherwise the objects so far are read
with partial-json-parser (vLLM's reader; names only once whole), a call's name goes out when
it is, its arguments as the common prefix of two successive readings (so the closers partial
reading adds are held back) and in full once its object is complete JSON; when the next object
starts, what the previous one still owed goes out first. vLLM's quirks are kept: a call with
`{}` arguments streams no arguments, and a delta that starts two objects at once skips the
first (vLLM jumps to the last). On the last delta, a tool-call delta also carries the arguments
read but not yet streamed (vLLM's finalize_generation). What vLLM's stream would still leave
out of the whole answer, ToolCallStream sends after that (tool_parsers.py, a difference from
vLLM that docs/serving.md names).
"""

from __future__ import annotations

import json
import logging
import re
from json import JSONDecodeError, JSONDecoder

log = logging.getLogger(__name__)

BOT_TOKEN = "<|python_tag|>"
_OPEN = re.compile(r"\{")


def check_tokenizer(tokenizer) -> None:
    """ConfigError unless the tokenizer has <|python_tag|>: vLLM's parser refuses it too."""
    from shoal.engine.entrypoints.reasoning import _token_id
    from shoal.engine.errors import ConfigError

    if _token_id(tokenizer, BOT_TOKEN) is None:
        raise ConfigError(f"--tool-call-parser llama3_json: could not locate the bot token "
                          f"'{BOT_TOKEN}' in the model's tokenizer (as vLLM's "
                          "Llama3JsonToolParser refuses it); serve a Llama 3.1+ tokenizer or "
                          "choose another parser")


def parse_whole(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """(content, [(name, arguments JSON)]) of a finished output."""
    if BOT_TOKEN not in text and "{" not in text:
        return text, []
    decoder, end, calls = JSONDecoder(), -1, []
    for match in _OPEN.finditer(text):
        start = match.start()
        if start <= end:  # inside (or right at the end of) the previous object
            continue
        try:
            obj, length = decoder.raw_decode(text[start:])
            end = start + length
            name = obj["name"]
            args = obj["arguments"] if "arguments" in obj else obj["parameters"]
            if not isinstance(name, str):
                raise TypeError(f"name is {type(name).__name__}")
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("llama3_json tool parser: output is content, a JSON object failed: "
                        "%s: %s", type(exc).__name__, exc)
            return text, []
        calls.append((name, json.dumps(args, ensure_ascii=False)))
    return (None, calls) if calls else (text, [])


def _partial_loads(text: str, flags):
    """vLLM's partial_json_loads: (object, characters read)."""
    import partial_json_parser

    try:
        return partial_json_parser.loads(text, flags), len(text)
    except JSONDecodeError as exc:
        if "Extra data" in exc.msg:
            return JSONDecoder().raw_decode(text)
        raise


def _is_complete(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _common_prefix(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def _args_delta(index: int, arguments: str) -> dict:
    return {"tool_calls": [{"index": index, "function": {"arguments": arguments}}]}


class Llama3JsonStream:
    """One choice's streaming state: `feed(text so far, delta)` -> its chat deltas; a name's
    delta is marked with `"new_call": True` for the caller to give it an id."""

    def __init__(self) -> None:
        self.prev: list = []  # the objects read at the last step that got that far
        self.current = -1  # the call being streamed
        self.name_sent = False
        self.sent: list[str] = []  # the arguments streamed, per call

    def feed(self, current: str, delta: str, final: bool = False) -> list[dict]:
        if not current.startswith((BOT_TOKEN, "{")):
            return [{"content": delta}] if delta else []
        try:
            out = self._step(current)
        except Exception as exc:  # noqa: BLE001 - vLLM skips the delta on any error
            log.debug("llama3_json tool parser: delta skipped: %s: %s", type(exc).__name__, exc)
            return []
        if out is None:
            return []
        if final and out.get("tool_calls"):
            fn = out["tool_calls"][-1]["function"]
            fn["arguments"] = fn.get("arguments", "") + self._unstreamed()
        return [out]

    def _unstreamed(self) -> str:
        """vLLM's get_remaining_unstreamed_args: the last call's arguments not yet sent."""
        if not self.prev:
            return ""
        index = len(self.prev) - 1
        args = self.prev[index].get("arguments", {})
        expected = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        actual = self.sent[index] if index < len(self.sent) else ""
        return expected[len(actual):] if expected.startswith(actual) else ""

    def _read(self, current: str) -> tuple[list, list[bool]] | None:
        from partial_json_parser.core.exceptions import MalformedJSON
        from partial_json_parser.core.options import Allow

        flags = Allow.ALL if self.name_sent else Allow.ALL & ~Allow.STR
        objs, complete = [], []
        start = len(BOT_TOKEN) if current.startswith(BOT_TOKEN) else 0
        try:
            while start < len(current):
                obj, end = _partial_loads(current[start:], flags)
                complete.append(_is_complete(current[start:start + end]))
                start += end + len("; ")
                if "parameters" in obj:
                    if "arguments" in obj:
                        raise ValueError("model generated both parameters and arguments")
                    obj["arguments"] = obj["parameters"]
                objs.append(obj)
        except MalformedJSON:
            return None  # not enough text to read yet
        return objs, complete

    def _step(self, current: str) -> dict | None:
        read = self._read(current)
        if read is None:
            return None
        objs, complete = read
        if not objs:
            return None
        call = objs[self.current]
        if len(objs) > self.current + 1:  # a new call starts: first what the last one owes
            out = None
            if self.current >= 0 and call.get("arguments"):
                whole = json.dumps(call["arguments"], ensure_ascii=False)
                diff = whole[len(self.sent[self.current]):]
                out = _args_delta(self.current, diff)
                self.sent[self.current] += diff
            self.current, self.name_sent = len(objs) - 1, False
            self.sent.append("")
            return out
        out = None
        if not self.name_sent:
            if call.get("name"):
                out = {"tool_calls": [{"index": self.current, "type": "function",
                                       "function": {"name": call["name"], "arguments": ""}}],
                       "new_call": True}
                self.name_sent = True
        elif call.get("arguments"):
            sent = len(self.sent[self.current])
            now = json.dumps(call["arguments"], ensure_ascii=False)
            before = self.prev[self.current].get("arguments")
            diff = None
            if complete[self.current]:
                diff = now[sent:]
            elif before:
                was = json.dumps(before, ensure_ascii=False)
                if now != was:
                    diff = _common_prefix(was, now)[sent:]
            if diff is not None:
                out = _args_delta(self.current, diff)
                self.sent[self.current] += diff
        self.prev = objs
        return out
