"""Streamed hermes outputs (the text of each delta) shared by the parity test and vLLM's side.
Run inside vLLM's venv, this file prints what vLLM's own Hermes2ProToolParser streams for each
case (`python tool_stream_cases.py > answers.json`), as [content pieces, {index: name},
{index: [argument fragments]}]."""

from __future__ import annotations

import json

CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo", "days": 3}}\n</tool_call>'
CASES = [
    ["Let me check. ", CALL[:5], CALL[5:30], CALL[30:48], CALL[48:60], CALL[60:]],
    [CALL[i:i + 3] for i in range(0, len(CALL), 3)],  # three characters a delta
    [CALL, CALL.replace("Oslo", "Rome")],  # two calls
    ["no tools here", " at all"],
    ['<tool_call>{"name": "f", "arguments": {}}</tool_call>'],
]


def events(deltas: list[dict]) -> list:
    """[content pieces, {index: name}, {index: [argument fragments]}] of chat deltas."""
    content, names, args = [], {}, {}
    for d in deltas:
        if d.get("content"):
            content.append(d["content"])
        for call in d.get("tool_calls") or []:
            fn = call.get("function") or {}
            if fn.get("name"):
                names[str(call["index"])] = fn["name"]
            if fn.get("arguments"):
                args.setdefault(str(call["index"]), []).append(fn["arguments"])
    return [content, names, args]


def _vllm() -> list:
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

    out = []
    for case in CASES:
        parser, prev, deltas = Hermes2ProToolParser(object()), "", []
        for piece in case:
            d = parser.extract_tool_calls_streaming(prev, prev + piece, piece, [], [], [], None)
            prev += piece
            if d is not None:
                deltas.append(d.model_dump(exclude_none=True))
        out.append(events(deltas))
    return out


if __name__ == "__main__":
    print(json.dumps(_vllm()))
