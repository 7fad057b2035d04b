"""Token streams of a `<think>` model (text and ids per delta) shared by the reasoning tests and
the vLLM parity run; THINK and END are the ids the test tokenizer gives `<think>` / `</think>`.
Run inside vLLM's venv, this file prints vLLM's own DeepSeekR1ReasoningParser's answers
(`python reasoning_cases.py THINK END`), or its Qwen3Parser's on QWEN3_CASES
(`python reasoning_cases.py qwen3 TOKENIZER_DIR`)."""

from __future__ import annotations

import json
import sys

# Each case: [(delta text, delta token ids)], with symbolic ids "S" / "E" for the think tokens.
CASES = [
    [("<think>", ["S"]), ("ab", [1]), ("c", [2]), ("</think>", ["E"]), ("\n\nhi", [3, 4])],
    [("ab", [1]), ("</think>", ["E"]), ("yes", [3])],  # the template opened the thinking
    [("<think>x", ["S", 1]), ("y</think>z", [2, "E", 3]), ("!", [4])],
    [("<think>x</think>", ["S", 1, "E"])],  # nothing after the thinking: content null
    [("plain", [1]), (" text", [2])],  # never a </think>: all reasoning (deepseek_r1)
    [("a</think>", [1, "E"]), ("b", [2])],
]

# qwen3's parser (vLLM 0.32's parser engine) reads token ids from a real tokenizer: these are
# delta texts, tokenized on both sides by the same tokenizer.json (the tiny model's with the
# two think tokens added).
QWEN3_CASES = [[t for t, _ in case] for case in CASES] + [
    ["ab", '<tool_call>{"name": "f"}</tool_call>'],  # a tool call ends the reasoning
    ["a</think>b", "<think>c"],  # <think> in the content is text
    ["a", "</think>", "b</think>c"],  # a later </think> is dropped
    ["x\n\n", "</think>\n\n", "y"],  # whitespace that starts the content waits
    ["a</think>", "b", " ", "c", "\n"],
    ["a</think>", "  ", " x"],
    ["a", "<tool", "_call>"],  # what could begin a tag waits
    ["a<", "/think>b"],  # </think> spelled in pieces is text, not the token
]


def resolve(case, start: int, end: int) -> list[tuple[str, list[int]]]:
    return [(t, [start if i == "S" else end if i == "E" else i for i in ids]) for t, ids in case]


def _vllm_answers(start: int, end: int) -> list[dict]:
    from vllm.reasoning.deepseek_r1_reasoning_parser import DeepSeekR1ReasoningParser

    class Tok:
        def get_vocab(self):
            return {"<think>": start, "</think>": end}

    answers = []
    for case in CASES:
        parser = DeepSeekR1ReasoningParser(Tok())
        deltas, prev_text, prev_ids = [], "", []
        for text, ids in resolve(case, start, end):
            d = parser.extract_reasoning_streaming(prev_text, prev_text + text, text, prev_ids,
                                                   prev_ids + ids, ids)
            deltas.append(None if d is None else
                          d.model_dump(exclude_unset=True, include={"reasoning", "content"}))
            prev_text, prev_ids = prev_text + text, prev_ids + ids
        answers.append({"deltas": deltas, "whole": list(parser.extract_reasoning(prev_text,
                                                                                 None))})
    return answers


def _vllm_qwen3(tokenizer_dir: str) -> list[dict]:
    from vllm.parser.engine.adapters import make_adapters
    from vllm.parser.qwen3 import Qwen3Parser  # not via the registry: it imports mistral's
    from vllm.tokenizers import get_tokenizer

    adapter, _ = make_adapters(Qwen3Parser)
    tok = get_tokenizer(tokenizer_dir)
    answers = []
    for case in QWEN3_CASES:
        parser, deltas, prev_text, prev_ids = adapter(tok), [], "", []
        for text in case:
            ids = tok.encode(text, add_special_tokens=False)
            d = parser.extract_reasoning_streaming(prev_text, prev_text + text, text, prev_ids,
                                                   prev_ids + ids, ids)
            deltas.append(None if d is None else
                          d.model_dump(exclude_unset=True, include={"reasoning", "content"}))
            prev_text, prev_ids = prev_text + text, prev_ids + ids
        answers.append({"deltas": deltas,
                        "whole": list(adapter(tok).extract_reasoning(prev_text, None))})
    return answers


if __name__ == "__main__":
    if sys.argv[1] == "qwen3":
        json.dump(_vllm_qwen3(sys.argv[2]), sys.stdout)
    else:
        json.dump(_vllm_answers(int(sys.argv[1]), int(sys.argv[2])), sys.stdout)
