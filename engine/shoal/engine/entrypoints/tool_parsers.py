"""Reading tool calls out of generated text, whole or as it streams.

Three shapes, one per ToolPlan mode:
- "named": the whole text is the arguments of the named function;
- "required": the compact JSON array `[{"name":"f","parameters":{...}},...]` that the grammar
  enforces (no free whitespace: spec.py), read incrementally, so arguments stream as fragments;
- "auto" with the hermes parser: text, then
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (vLLM's
  `--tool-call-parser hermes`). Streamed as vLLM streams them (stream_hermes): a block's first
  delta carries the id and name as soon as the name is whole, the next ones its arguments as
  the model writes them.

`ToolCallStream.feed(text_so_far)` returns the chat deltas to send, in OpenAI's shapes: the first
delta of a call carries `index`, `id`, `type: "function"`, `function.name` and `arguments: ""`;
later deltas carry `index` and argument fragments.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field

from shoal.engine.entrypoints.llama3_json_tool_calls import Llama3JsonStream, parse_whole
from shoal.engine.entrypoints.pythonic_tool_calls import parse_pythonic
from shoal.engine.entrypoints.qwen3_coder_tool_calls import parse_qwen3_coder
from shoal.engine.entrypoints.tool_calls import ToolPlan, new_call_id

log = logging.getLogger(__name__)

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(re.escape(HERMES_OPEN) + r"(.*?)" + re.escape(HERMES_CLOSE), re.S)


@dataclass
class ParsedCall:
    name: str
    arguments: str  # a JSON text
    complete: bool = True


def _string_end(text: str, i: int) -> int:
    """Index after the JSON string starting at text[i] == '"'; -1 if it is not closed yet."""
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return -1


def _value_end(text: str, i: int) -> int:
    """Index after the JSON value starting at text[i]; -1 if it is not complete yet."""
    if i >= len(text):
        return -1
    if text[i] == '"':
        return _string_end(text, i)
    if text[i] not in "{[":
        m = re.compile(r"[^,}\]]*").match(text, i)
        return m.end() if m.end() < len(text) else -1
    depth, j = 0, i
    while j < len(text):
        c = text[j]
        if c == '"':
            j = _string_end(text, j)
            if j < 0:
                return -1
            continue
        if c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return -1


def scan_required(text: str) -> list[ParsedCall]:
    """The calls in a (possibly partial) compact `[{"name":..,"parameters":..},...]`; the last
    one may be incomplete (its arguments so far)."""
    calls: list[ParsedCall] = []
    if not text.startswith("["):
        return calls
    i = 1
    while text.startswith('{"name":', i):
        i += len('{"name":')
        end = _string_end(text, i) if text.startswith('"', i) else -1
        if end < 0:
            break
        name = json.loads(text[i:end])
        i = end
        if not text.startswith(',"parameters":', i):
            calls.append(ParsedCall(name, "", False))
            break
        i += len(',"parameters":')
        end = _value_end(text, i)
        if end < 0:
            calls.append(ParsedCall(name, text[i:], False))
            break
        calls.append(ParsedCall(name, text[i:end]))
        i = end
        if not text.startswith("},", i):
            break
        i += 2
    return calls


def parse_hermes(text: str, final: bool = True) -> tuple[str, list[ParsedCall]]:
    """(content before the first block, the closed blocks that parse). While streaming
    (`final` False) content stops short of anything that could be the start of a block."""
    start = text.find(HERMES_OPEN)
    if start < 0:
        if final:
            return text, []
        hold = next((k for k in range(min(len(HERMES_OPEN) - 1, len(text)), 0, -1)
                     if HERMES_OPEN.startswith(text[-k:])), 0)
        return text[:len(text) - hold], []
    calls = []
    for block in _HERMES_BLOCK.findall(text, start):
        try:
            obj = json.loads(block.strip())
            name, args = obj["name"], obj.get("arguments", {})
        except (ValueError, KeyError, TypeError):
            log.warning("hermes tool parser: a <tool_call> block is not JSON with a name: %r",
                        block[:200])
            continue
        args_text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        calls.append(ParsedCall(str(name), args_text))
    return text[:start], calls


def _tag_overlap(text: str, tag: str) -> int:
    """How much of `tag`'s start ends `text` (vLLM's partial_tag_overlap)."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1)
                 if text.endswith(tag[:k])), 0)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


_HERMES_NAME = re.compile(r'"name"\s*:\s*"([^"]+)"')
_HERMES_ARGS = re.compile(r'"arguments"\s*:\s*')


def stream_hermes(text: str, final: bool = False) -> tuple[str, list[ParsedCall]]:
    """vLLM's streaming reading of hermes output (Hermes2ProToolParser): content before the
    first `<tool_call>` (holding back what could start one, until `final`); per block, open or
    closed, its name once the `"name": "..."` is whole, and its arguments as the model writes
    them (the raw text after `"arguments":`, less the `}` that closes the block's object once
    it is complete JSON), so arguments stream as they arrive."""
    start = text.find(HERMES_OPEN)
    if start < 0:
        return text[:len(text) - (0 if final else _tag_overlap(text, HERMES_OPEN))], []
    calls, pos = [], start
    while (start := text.find(HERMES_OPEN, pos)) >= 0:
        body_at = start + len(HERMES_OPEN)
        end = text.find(HERMES_CLOSE, body_at)
        if end >= 0:
            body, complete, pos = text[body_at:end].strip(), True, end + len(HERMES_CLOSE)
        else:
            raw = text[body_at:]
            raw = raw[:len(raw) - _tag_overlap(raw, HERMES_CLOSE)].strip()
            body, complete, pos = raw, bool(raw) and _is_json(raw), len(text)
        name = _HERMES_NAME.search(body)
        if name is None:
            break  # a later block waits for this one's name
        args = _HERMES_ARGS.search(body)
        raw_args = body[args.end():] if args else ""
        if complete and raw_args:
            raw_args = raw_args.rstrip()
            raw_args = (raw_args[:-1] if raw_args.endswith("}") else raw_args).rstrip()
        calls.append(ParsedCall(name.group(1), raw_args, complete))
    return text[:text.find(HERMES_OPEN)], calls


def calls_in(plan: ToolPlan, text: str, final: bool = True,
             streaming: bool = False) -> tuple[str | None, list[ParsedCall]]:
    """(content, tool calls) of the text generated under `plan`; `streaming`: hermes blocks
    as vLLM streams them (stream_hermes), else as it answers whole (parse_hermes)."""
    if plan.mode == "named":
        return None, [ParsedCall(plan.function_name, text)]
    if plan.mode == "required":
        return None, scan_required(text)
    if plan.mode == "auto" and plan.parser == "qwen3_coder":
        content, found = parse_qwen3_coder(text, plan.tools, final, streaming)
        calls = [ParsedCall(*call) for call in found]
        return content, calls if plan.parallel else calls[:1]
    if plan.mode == "auto" and plan.parser == "llama3_json":  # streamed: Llama3JsonStream
        content, found = parse_whole(text)
        calls = [ParsedCall(name, args) for name, args in found]
        return content, calls if plan.parallel else calls[:1]
    if plan.mode == "auto" and plan.parser == "pythonic":
        content, found = parse_pythonic(text, final, streaming)
        if found is None:  # streaming, nothing new can be read yet
            return None, None
        calls = [ParsedCall(*call) for call in found]
        return content, calls if plan.parallel else calls[:1]
    if plan.mode == "auto":
        content, calls = (stream_hermes(text, final) if streaming
                          else parse_hermes(text, final))
        if not plan.parallel:
            calls = calls[:1]
        return content, calls
    return text, []


def message_tool_calls(calls: list[ParsedCall]) -> list[dict]:
    return [{"id": new_call_id(), "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


@dataclass
class ToolCallStream:
    """Turns the growing text of one choice into chat deltas (see the module docstring)."""

    plan: ToolPlan
    text: str = ""
    content_sent: int = 0
    args_sent: list[int] = field(default_factory=list)
    llama3: Llama3JsonStream | None = None  # llama3_json streams through vLLM's state machine
    names_sent: set[int] = field(default_factory=set)  # llama3_json: calls whose name went out
    args_text: dict[int, str] = field(default_factory=dict)  # llama3_json: arguments sent

    def __post_init__(self) -> None:
        if self.plan.mode == "auto" and self.plan.parser == "llama3_json":
            self.llama3 = Llama3JsonStream()

    def _feed_llama3(self, delta: str, final: bool) -> list[dict]:
        out = [d for d in self.llama3.feed(self.text, delta, final) if self._keep(d)]
        if final:
            out += self._llama3_owed()
        return out

    def _keep(self, d: dict) -> bool:
        """Track a llama3_json delta (names and arguments sent per call); False for calls past
        the first when parallel_tool_calls is false."""
        calls = d.get("tool_calls") or []
        if not calls:
            self.content_sent += len(d.get("content") or "")
            return True
        call = calls[0]
        if call["index"] > 0 and not self.plan.parallel:
            return False
        if d.pop("new_call", False):
            call["id"] = new_call_id()
            self.names_sent.add(call["index"])
        self.args_text.setdefault(call["index"], "")
        self.args_text[call["index"]] += call["function"].get("arguments", "")
        self.args_sent = [len(self.args_text.get(i, "")) for i in sorted(self.names_sent)]
        return True

    def _llama3_owed(self) -> list[dict]:
        """What vLLM's stream would leave out of the whole answer (a call whose name or
        arguments it skipped, output that is neither content nor calls), sent at the end, so
        the streamed answer is the whole answer's (docs/serving.md, a difference from vLLM)."""
        content, calls = calls_in(self.plan, self.text)
        if not calls:
            rest = (content or "")[self.content_sent:]
            return [{"content": rest}] if rest and not self.names_sent else []
        out = []
        for index, call in enumerate(calls):
            if index not in self.names_sent:
                out.append({"tool_calls": [{"index": index, "id": new_call_id(),
                                            "type": "function",
                                            "function": {"name": call.name, "arguments": ""}}]})
                self.names_sent.add(index)
            sent = self.args_text.get(index, "")
            if call.arguments.startswith(sent) and len(call.arguments) > len(sent):
                out.append({"tool_calls": [{"index": index, "function": {
                    "arguments": call.arguments[len(sent):]}}]})
                self.args_text[index] = call.arguments
            elif not call.arguments.startswith(sent):
                log.warning("llama3_json tool parser: call %d streamed arguments %r that are not "
                            "a prefix of the whole answer's %r", index, sent[:80],
                            call.arguments[:80])
        self.args_sent = [len(self.args_text.get(i, "")) for i in sorted(self.names_sent)]
        return out

    def feed(self, delta: str, final: bool = False) -> list[dict]:
        self.text += delta
        if self.llama3 is not None:
            return self._feed_llama3(delta, final)
        content, calls = calls_in(self.plan, self.text, final, streaming=True)
        out: list[dict] = []
        if calls is None:  # nothing can be read out yet
            return out
        if content and len(content) > self.content_sent:
            out.append({"content": content[self.content_sent:]})
            self.content_sent = len(content)
        for index, call in enumerate(calls):
            if index == len(self.args_sent):
                out.append({"tool_calls": [{"index": index, "id": new_call_id(),
                                            "type": "function",
                                            "function": {"name": call.name, "arguments": ""}}]})
                self.args_sent.append(0)
            if len(call.arguments) > self.args_sent[index]:
                out.append({"tool_calls": [{"index": index, "function": {
                    "arguments": call.arguments[self.args_sent[index]:]}}]})
                self.args_sent[index] = len(call.arguments)
        return out

    @property
    def num_calls(self) -> int:
        return len(self.args_sent)
