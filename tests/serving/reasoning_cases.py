"""Token streams of a `<think>` model (text and ids per delta) shared by the reasoning tests and
the vLLM parity run; THINK and END are the ids the test tokenizer gives `<think>` / `</think>`.
Run inside vLLM's venv, this file prints vLLM's own DeepSeekR1ReasoningParser's answers
(`python reasoning_cases.py THINK END < cases.json > answers.json`)."""

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


if __name__ == "__main__":
    json.dump(_vllm_answers(int(sys.argv[1]), int(sys.argv[2])), sys.stdout)
