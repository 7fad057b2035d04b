"""`--tool-call-parser pythonic` (Llama 3.2 / 4 style): the model answers tool calls as a Python
list of calls, `[get_weather(city="Oslo", days=3), other()]`, read with `ast` as vLLM's
PythonicToolParser reads them.

Whole: an output that is exactly such a list (keyword arguments of literals only: strings,
numbers, None/True/False and JSON's null/true/false, lists, tuples, sets, dicts with literal
keys, signed numbers) becomes tool calls with `content` null; anything else is plain content.
Streamed, as vLLM: an output that does not start with `[` is content as it comes; one that does
is closed with the brackets and quotes it still owes (`close_partial`), parsed, and each call's
arguments are its JSON so far less the part that only those added closers wrote, so a call's
name goes out as soon as it parses and its arguments grow as they are written; nothing goes
out while the text ends inside a parameter name, after `=` or `:`.
"""

from __future__ import annotations

import ast
import json
from typing import Any

_NAME_LITERALS = {"null": None, "true": True, "false": False}
_CLOSERS = {"[": "]", "(": ")", "{": "}", "'": "'", '"': '"'}


class NotACall(ValueError):
    """The text is not a list of calls with literal arguments."""


def _value(node: ast.expr) -> Any:
    if isinstance(node, ast.Constant) and (node.value is None
                                           or isinstance(node.value, (str, int, float))):
        return node.value
    if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) for k in node.keys):
        return {k.value: _value(v) for k, v in zip(node.keys, node.values, strict=True)}
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return [_value(v) for v in node.elts]
    if isinstance(node, ast.JoinedStr) and all(isinstance(p, ast.Constant) for p in node.values):
        return "".join(str(p.value) for p in node.values)
    if isinstance(node, ast.Name) and node.id in _NAME_LITERALS:
        return _NAME_LITERALS[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        inner = _value(node.operand)
        if isinstance(inner, (int, float)) and not isinstance(inner, bool):
            return -inner if isinstance(node.op, ast.USub) else inner
    raise NotACall(f"not a literal argument: {ast.dump(node)[:80]}")


def _dotted(node: ast.expr) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        raise NotACall("a call's target is not a name")
    return ".".join([node.id, *reversed(parts)])


def calls_of(text: str, dotted: bool = True) -> list[tuple[str, str]]:
    """[(name, arguments JSON)] of a list-of-calls text; NotACall if it is not one. Whole
    outputs take plain names only (`dotted` False: vLLM's pattern for them has no dots)."""
    try:
        body = ast.parse(text).body
    except SyntaxError as exc:
        raise NotACall(str(exc)) from None
    node = getattr(body[0], "value", None) if len(body) == 1 else None
    if not isinstance(node, ast.List) or not node.elts or not all(
            isinstance(e, ast.Call) and not e.args and (dotted or isinstance(e.func, ast.Name))
            for e in node.elts):
        raise NotACall("not a list of calls with keyword arguments")
    return [(_dotted(call.func), json.dumps({k.arg: _value(k.value) for k in call.keywords},
                                            ensure_ascii=False)) for call in node.elts]


def _escaped(text: str, i: int) -> bool:
    backslashes = 0
    while i - backslashes - 1 >= 0 and text[i - backslashes - 1] == "\\":
        backslashes += 1
    return backslashes % 2 == 1


def close_partial(text: str) -> tuple[str, str] | None:
    """(text closed, the closers added) for a partial list of calls, or None while it cannot
    be closed into something meaningful yet (vLLM's make_valid_python)."""
    stack: list[str] = []
    for i, c in enumerate(text):
        if stack and stack[-1] in "'\"":
            if c == stack[-1] and not _escaped(text, i):
                stack.pop()
            continue
        if c in "[({'\"":
            stack.append(c)
        elif c in "])}":
            if not stack or _CLOSERS[stack.pop()] != c:
                raise NotACall("mismatched brackets")
    text = text.rstrip()
    if text.endswith(("=", ":")):
        return None
    if stack and stack[-1] == "{":
        before = text[:text.rfind("{")]
        if before.count(":") <= before.count(","):
            return None
    if stack and stack[-1] == "(":
        before = text[:text.rfind("(")]
        if before.count("=") <= before.count(","):
            return None
    if text.endswith(","):
        text = text[:-1]
    if stack and stack[-1] == "[" and not text.endswith(("[", ")")):
        return None
    added = "".join(_CLOSERS[c] for c in reversed(stack))
    try:
        module = ast.parse(text + added)
    except SyntaxError:
        return None
    if not module.body or ("}" in added and any(isinstance(n, ast.Set)
                                                for n in ast.walk(module))):
        return None
    return text + added, added


def parse_pythonic(text: str, final: bool = True, streaming: bool = False):
    """(content, [(name, arguments, complete)]) of the text so far; see the module docstring."""
    if not streaming:
        try:
            return None, [(n, a, True) for n, a in calls_of(text, dotted=False)]
        except NotACall:
            return text, []
    if not text.startswith("["):
        return text, []
    try:
        closed = close_partial(text)
        if closed is None:
            return "", None  # nothing to add yet
        whole, added = closed
        calls = calls_of(whole)
    except NotACall:
        return "", None
    out = []
    for index, (name, args) in enumerate(calls):
        complete = index < len(calls) - 1 or ")]" not in added
        held = "" if complete else added[:-2] + ("}" if added[-2] == ")" else "")
        held = held.replace("'", '"')
        if held and not args.endswith(held):
            return "", None  # vLLM drops such a delta (its compute_tool_delta raises)
        args = args[:len(args) - len(held)]
        out.append((name, args, complete))
    return "", out
