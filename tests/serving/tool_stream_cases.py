"""Streamed hermes outputs (the text of each delta) shared by the parity test and vLLM's side.
Run inside vLLM's venv, this file prints what vLLM's own Hermes2ProToolParser and
PythonicToolParser stream for each case (`python tool_stream_cases.py > answers.json`), as
[content pieces, {index: name}, {index: [argument fragments]}], and what PythonicToolParser
reads from whole outputs."""

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

PY = '[get_weather(city="Oslo", days=3, units={"t": "C"}), ping(), find(q=\'a, b\', n=-2)]'
PYTHONIC = [
    [PY[i:i + 4] for i in range(0, len(PY), 4)],
    [PY[i:i + 1] for i in range(0, len(PY), 1)],
    [PY],
    ["Sure: ", "no calls"],
    ['[f(a=[1, 2', '], b=None)]'],
]
# Whole outputs: tool calls or plain content, as vLLM's extract_tool_calls reads them.
PYTHONIC_WHOLE = [PY, "[f()]", "[f(1)]", " [f()]", "[a.b(x=1)]", "[]", "[f(x=null, y=true)]",
                  "text [f()]", "[f(x=1)] trailing", "[f(x=1)]\n", "[f(x=b'z')]"]

# qwen3_coder: XML calls typed by the tools' schemas (vLLM reads token ids, so its side needs a
# real tokenizer: `python tool_stream_cases.py qwen3_coder TOKENIZER_DIR`).
QWEN3_TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "hot": {"type": "boolean"}, "tags": {"type": "array"}}}}},
    {"type": "function", "function": {"name": "ping"}}]
XML = ("<tool_call>\n<function=weather>\n<parameter=city>\nNew\nYork \"x\"\n</parameter>\n"
       "<parameter=days>\n12\n</parameter>\n<parameter=hot>\ntrue\n</parameter>\n"
       "<parameter=tags>\n[1, 2]\n</parameter>\n<parameter=extra>\nq\n</parameter>\n"
       "</function>\n</tool_call>\n<tool_call>\n<function=ping>\n<parameter=a>\nb\n"
       "</parameter>\n</function>\n</tool_call>")
QWEN3_CODER = [
    ["Sure. ", XML[:15], XML[15:40], XML[40:70], XML[70:]],
    list(XML),
    [XML[i:i + 5] for i in range(0, len(XML), 5)],
    [XML],
    ["no calls", " here"],
]

# llama3_json: JSON calls, "; "-separated, after <|python_tag|> or not (vLLM's side needs a
# tokenizer with that token only: its parser checks the vocabulary).
BOT = "<|python_tag|>"
J1 = '{"name": "weather", "parameters": {"city": "Oslo", "days": 3, "tags": ["a", "b"]}}'
J2 = '{"name": "ping", "arguments": {}}'
J3 = '{"name": "find", "parameters": {"q": "a \\"b\\" \u00e9", "n": -2.5, "x": null}}'
LLAMA3 = [
    [J1[i:i + 3] for i in range(0, len(J1), 3)],
    [BOT, *list(J1 + "; " + J3)],  # <|python_tag|> is one token
    [(J1 + "; " + J2)[i:i + 5] for i in range(0, len(J1 + "; " + J2), 5)],
    [(J3 + "; " + J1)[i:i + 7] for i in range(0, len(J3 + "; " + J1), 7)],
    ["Sure: ", "no calls", " {here}"],
    [J1],
    [BOT, J1[:20], J1[20:]],
    [J1[:30], J1[30:] + "; " + J2[:10], J2[10:]],
]
LLAMA3_WHOLE = [J1, BOT + J1, J1 + "; " + J2, BOT + J3 + "; " + J1, "text " + J1 + " more",
                "{not json", '{"name": "f"}', "plain text", '{"name": 1, "parameters": {}}',
                '{"name": "a", "parameters": {}}{"name": "b", "parameters": {}}',
                '{"a": {"name": "x", "parameters": {}}}', J1 + "\n", "[" + J1 + "]"]


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


def _vllm() -> dict:
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
    from vllm.tool_parsers.pythonic_tool_parser import PythonicToolParser

    whole = []
    for text in PYTHONIC_WHOLE:
        got = PythonicToolParser(object()).extract_tool_calls(text, None)
        whole.append([got.content, [[c.function.name, c.function.arguments]
                                    for c in got.tool_calls]])
    return {"hermes": _streamed(Hermes2ProToolParser, CASES),
            "pythonic": _streamed(PythonicToolParser, PYTHONIC), "pythonic_whole": whole,
            **_vllm_llama3()}


class _BotVocab:
    """What Llama3JsonToolParser reads of a tokenizer: that <|python_tag|> is in it."""

    def get_vocab(self) -> dict:
        return {BOT: 128010}


def _vllm_llama3() -> dict:
    from vllm.tool_parsers.llama_tool_parser import Llama3JsonToolParser

    def whole(text: str) -> list:
        got = Llama3JsonToolParser(_BotVocab()).extract_tool_calls(text, None)
        return [got.content, [[c.function.name, c.function.arguments] for c in got.tool_calls]]

    return {"llama3": _streamed(Llama3JsonToolParser, LLAMA3, _BotVocab(), finalize=True),
            "llama3_joined": [whole("".join(case)) for case in LLAMA3],
            "llama3_whole": [whole(text) for text in LLAMA3_WHOLE]}


def _streamed(parser_class, cases, tokenizer=None, finalize: bool = False) -> list:
    """The parser's deltas; `finalize`: the last one gets what vLLM's parse_delta adds when the
    output finishes (DelegatingParser._append_unstreamed_tool_args)."""
    out = []
    for case in cases:
        parser, prev, deltas = parser_class(tokenizer or object()), "", []
        for n, piece in enumerate(case):
            d = parser.extract_tool_calls_streaming(prev, prev + piece, piece, [], [], [], None)
            prev += piece
            if finalize and n == len(case) - 1 and d is not None and d.tool_calls \
                    and d.tool_calls[-1].function:
                fn = d.tool_calls[-1].function
                fn.arguments = (fn.arguments or "") + parser.get_remaining_unstreamed_args()
            if d is not None:
                deltas.append(d.model_dump(exclude_none=True))
        out.append(events(deltas))
    return out


def _vllm_qwen3_coder(tokenizer_dir: str) -> dict:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser.engine.adapters import make_adapters
    from vllm.parser.qwen3 import Qwen3Parser  # not via the registry: it imports mistral's
    from vllm.tokenizers import get_tokenizer

    _, adapter = make_adapters(Qwen3Parser)
    tok = get_tokenizer(tokenizer_dir)
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "q"}],
                                    tools=QWEN3_TOOLS, tool_choice="auto")
    streamed, whole = [], []
    for case in QWEN3_CODER:
        parser, prev, prev_ids, deltas = adapter(tok, request.tools), "", [], []
        for piece in case:
            ids = tok.encode(piece, add_special_tokens=False)
            d = parser.extract_tool_calls_streaming(prev, prev + piece, piece, prev_ids,
                                                    prev_ids + ids, ids, request)
            prev, prev_ids = prev + piece, prev_ids + ids
            if d is not None:
                deltas.append(d.model_dump(exclude_none=True))
        streamed.append(events(deltas))
        got = adapter(tok, request.tools).extract_tool_calls(prev, request)
        whole.append([got.content, [[c.function.name, c.function.arguments]
                                    for c in got.tool_calls]])
    return {"streamed": streamed, "whole": whole}


if __name__ == "__main__":
    import sys

    if len(sys.argv) > 2 and sys.argv[1] == "qwen3_coder":
        print(json.dumps(_vllm_qwen3_coder(sys.argv[2])))
    else:
        print(json.dumps(_vllm()))
