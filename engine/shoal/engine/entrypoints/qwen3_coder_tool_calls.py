"""`--tool-call-parser qwen3_coder` (Qwen3-Coder's XML calls), read as vLLM 0.32's Qwen3Parser:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Oslo
    </parameter>
    </function>
    </tool_call>

A parameter's value loses one wrapping newline at each end and is typed by the tool's schema
(vLLM's coerce_to_schema_type: null, integer, number, boolean, object, array, then string, in
that order of preference; a value that fits none stays a string). Whole: `content` is the text
before the first call, stripped (null when empty). Streamed: content as it comes (holding what
could begin `<tool_call>`); a call's name once its `<function=...>` line is whole and a character
follows; its arguments as a JSON object that grows: `{"key": ` when a parameter's tag is whole,
a string-typed value character by character (a trailing newline or a partial closing tag
waits), other values when the next parameter or `</function>` arrives, `}` at `</function>`.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FUNC_OPEN, FUNC_CLOSE = "<function=", "</function>"
PARAM_OPEN, PARAM_CLOSE = "<parameter=", "</parameter>"
_ALIASES = {"str": "string", "text": "string", "varchar": "string", "char": "string",
            "enum": "string", "int": "integer", "int32": "integer", "int64": "integer",
            "uint": "integer", "uint32": "integer", "uint64": "integer", "long": "integer",
            "short": "integer", "unsigned": "integer", "float": "number", "float32": "number",
            "float64": "number", "double": "number", "bool": "boolean", "dict": "object",
            "arr": "array", "list": "array", "sequence": "array"}
_ENUM_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
               (list, "array"), (dict, "object"))


def schema_types(schema: Any) -> set[str]:
    """The JSON types a schema allows (type, enum values, anyOf/oneOf/allOf); {"string"} when
    it says nothing."""
    if not isinstance(schema, dict):
        return {"string"}
    kind = schema.get("type")
    types = {kind} if isinstance(kind, str) else {t for t in kind or [] if isinstance(t, str)}
    for value in schema.get("enum") or []:
        types.add("null" if value is None else
                  next((name for cls, name in _ENUM_TYPES if isinstance(value, cls)), "string"))
    for key in ("anyOf", "oneOf", "allOf"):
        for choice in schema.get(key) or []:
            types |= schema_types(choice)
    return types or {"string"}


def _finite(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except ValueError:
        return False
    return True


def _as(kind: str, value: str) -> tuple[bool, Any]:
    """(fits, the value as `kind`)."""
    if kind == "null":
        return value.lower() == "null", None
    if kind == "string":
        return True, value
    try:
        if kind == "integer":
            return True, int(value)
        if kind == "number":
            number = float(value)
            return math.isfinite(number), number if number != int(number) else int(number)
        if kind == "boolean":
            word = value.lower().strip()
            return word in ("true", "1", "false", "0"), word in ("true", "1")
        parsed = json.loads(value)
        return _finite(parsed), parsed
    except (ValueError, TypeError):
        return False, None


def coerce(value: str, types: set[str]) -> Any:
    """The raw value as the first of its schema's types it fits; else JSON, else the text."""
    wanted = {_ALIASES.get(t.strip().lower(), t.strip().lower()) for t in types}
    for kind in ("null", "integer", "number", "boolean", "object", "array", "string"):
        if kind in wanted:
            fits, typed = _as(kind, value)
            if fits:
                return typed
    try:
        parsed = json.loads(value)
    except ValueError:
        return value
    return parsed if _finite(parsed) else value


def _trim(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _overlap(text: str, tag: str) -> int:
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1)
                 if text.endswith(tag[:k])), 0)


def _properties(tools: list[dict], name: str) -> dict | None:
    for tool in tools:
        fn = tool.get("function") or {}
        if fn.get("name") == name:
            props = (fn.get("parameters") or {}).get("properties")
            return props if isinstance(props, dict) and props else None
    return None


def _params(body: str) -> list[tuple[str, str | None, bool]]:
    """[(name, raw value so far, closed)] of a call body; a parameter whose tag is not whole
    yet is left out."""
    out = []
    for m in re.finditer(re.escape(PARAM_OPEN) + r"([^>]*)>", body):
        rest = body[m.end():]
        nxt = rest.find(PARAM_OPEN)
        rest = rest if nxt < 0 else rest[:nxt]
        end = rest.find(PARAM_CLOSE)
        out.append((m.group(1), rest if end < 0 else rest[:end], end >= 0))
    return out


def _arguments(body: str, props: dict | None, done: bool) -> str:
    """The arguments JSON sent so far for one call body (see the module docstring)."""
    params = _params(body)
    streams = (lambda key: True) if props is None else (
        lambda key: key in props and schema_types(props[key]) == {"string"})
    typed = (lambda key, v: v) if props is None else (
        lambda key, v: coerce(v, schema_types(props[key])) if key in props else v)
    out = ""
    for i, (key, raw, closed) in enumerate(params):
        out += ("{" if i == 0 else "") + json.dumps(key, ensure_ascii=False) + ": "
        last = i == len(params) - 1
        if streams(key):
            value = raw[1:] if raw.startswith("\n") else raw
            if closed:
                value = value[:-1] if value.endswith("\n") else value
            else:
                value = value[:len(value) - max(_overlap(value, "\n" + PARAM_CLOSE),
                                                _overlap(value, PARAM_CLOSE))]
            out += '"' + json.dumps(value, ensure_ascii=False)[1:-1]
            if not last or done:
                out += '"'
        elif not last or done:  # a value that is not a string goes out whole
            out += json.dumps(typed(key, _trim(raw)), ensure_ascii=False)
        if not last:
            out += ", "
    if done:
        out += "}" if params else "{}"
    return out


def parse_qwen3_coder(text: str, tools: list[dict], final: bool = True,
                      streaming: bool = False) -> tuple[str | None, list[tuple[str, str, bool]]]:
    """(content, [(name, arguments, complete)]) of the text so far."""
    first = text.find(CALL_OPEN)
    if first < 0:
        return text[:len(text) - (0 if final or not streaming
                                  else _overlap(text, CALL_OPEN))], []
    calls = []
    for block in text[first:].split(CALL_OPEN)[1:]:
        block = block.split(CALL_CLOSE)[0]
        m = re.search(re.escape(FUNC_OPEN) + r"([^>\n]*)>", block)
        if m is None or (streaming and m.end() >= len(block) and not final):
            break  # the name is not whole yet (vLLM waits for the next character)
        name, body = m.group(1), block[m.end():]
        done = FUNC_CLOSE in body
        body = body.split(FUNC_CLOSE)[0]
        props = _properties(tools, name)
        if streaming:
            calls.append((name, _arguments(body, props, done), done))
        else:
            args = {key: _trim(raw) for key, raw, _ in _params(body)}
            if props is not None:
                args = {k: coerce(v, schema_types(props[k])) if k in props else v
                        for k, v in args.items()}
            calls.append((name, json.dumps(args, ensure_ascii=False), True))
    content = text[:first]
    if not streaming:
        content = content.strip() or None
    return content, calls
