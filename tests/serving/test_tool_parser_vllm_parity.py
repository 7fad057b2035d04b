"""hermes, pythonic, llama3_json and qwen3_coder under tool_choice "auto" stream as vLLM 0.32
streams them: the same deltas through vLLM's own Hermes2ProToolParser / PythonicToolParser /
Llama3JsonToolParser / Qwen3Parser (in
the cached vLLM venv,
support.vllm_cli) and through ToolCallStream give the same content pieces, names and argument
fragments; hermes arguments stream as they arrive, not only when the block closes; pythonic
whole outputs read as vLLM reads them."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from shoal.engine.entrypoints.tool_calls import ToolPlan
from shoal.engine.entrypoints.tool_parsers import ToolCallStream, calls_in
from support.vllm_cli import ensure_vllm_cli
from tool_stream_cases import (
    CALL,
    CASES,
    LLAMA3,
    LLAMA3_WHOLE,
    PYTHONIC,
    PYTHONIC_WHOLE,
    QWEN3_CODER,
    QWEN3_TOOLS,
    events,
)

pytestmark = pytest.mark.process


def _ours(case: list[str], parser: str = "hermes", tools: list | None = None) -> list:
    stream = ToolCallStream(ToolPlan("auto", tools or [], parser=parser))
    deltas = []
    for n, piece in enumerate(case):
        deltas += stream.feed(piece, final=n == len(case) - 1)
    return events(deltas)


@pytest.fixture(scope="module")
def vllm() -> dict:
    script = Path(__file__).with_name("tool_stream_cases.py")
    proc = subprocess.run([str(ensure_vllm_cli().python), str(script)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_hermes_streams_as_vllms_parser(vllm):
    for case, theirs in zip(CASES, vllm["hermes"], strict=True):
        assert _ours(case) == theirs, case


def test_pythonic_streams_as_vllms_parser(vllm):
    for case, theirs in zip(PYTHONIC, vllm["pythonic"], strict=True):
        assert _ours(case, "pythonic") == theirs, case


def test_pythonic_reads_whole_outputs_as_vllms_parser(vllm):
    plan = ToolPlan("auto", [], parser="pythonic")
    for text, (content, calls) in zip(PYTHONIC_WHOLE, vllm["pythonic_whole"], strict=True):
        ours_content, ours_calls = calls_in(plan, text)
        assert [ours_content, [[c.name, c.arguments] for c in ours_calls]] == \
            [content, calls], text


def _completed(streamed: list, whole: list) -> list:
    """vLLM's streamed events plus what Shoal sends at the end that vLLM's stream left out of
    its own whole answer (a call's name or arguments; output that is neither content nor a
    call)."""
    content, names, args = json.loads(json.dumps(streamed))
    whole_content, calls = whole
    if not calls and not names and whole_content[len("".join(content)):]:
        content.append(whole_content[len("".join(content)):])
    for i, (name, arguments) in enumerate(calls):
        names.setdefault(str(i), name)
        sent = "".join(args.get(str(i), []))
        if arguments.startswith(sent) and arguments != sent:
            args.setdefault(str(i), []).append(arguments[len(sent):])
    return [content, names, args]


def test_llama3_json_streams_as_vllms_parser(vllm):
    """Delta for delta as vLLM's parser (with its finalize step), then what its stream would
    have dropped (cases 3, 6 and 8: vLLM streams no arguments for `{}`, none of a call that
    arrives whole in one delta, and skips a name when one delta starts two calls)."""
    completed = 0
    for case, theirs, whole in zip(LLAMA3, vllm["llama3"], vllm["llama3_joined"], strict=True):
        want = _completed(theirs, whole)
        completed += want != theirs
        assert _ours(case, "llama3_json") == want, case
    assert completed == 3  # the others are vLLM's deltas exactly


def test_llama3_json_stream_carries_a_call_that_arrives_in_one_delta():
    stream = ToolCallStream(ToolPlan("auto", [], parser="llama3_json"))
    deltas = stream.feed(LLAMA3[5][0], final=True)
    assert events(deltas) == [[], {"0": "weather"}, {"0": [
        '{"city": "Oslo", "days": 3, "tags": ["a", "b"]}']}]
    assert stream.num_calls == 1


def test_llama3_json_reads_whole_outputs_as_vllms_parser(vllm):
    plan = ToolPlan("auto", [], parser="llama3_json")
    for text, (content, calls) in zip(LLAMA3_WHOLE, vllm["llama3_whole"], strict=True):
        ours_content, ours_calls = calls_in(plan, text)
        assert [ours_content, [[c.name, c.arguments] for c in ours_calls]] == \
            [content, calls], text


def test_hermes_arguments_stream_before_the_block_closes():
    stream = ToolCallStream(ToolPlan("auto", []))
    stream.feed(CALL[:40])
    sent = stream.feed(CALL[40:60])
    assert any((c.get("function") or {}).get("arguments") for d in sent
               for c in d.get("tool_calls", []))
    assert "</tool_call>" not in CALL[:60]


def test_qwen3_coder_streams_and_reads_as_vllms_parser(tiny_model, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "config.json"):
        if (Path(tiny_model) / name).exists():
            (tmp_path / name).write_bytes((Path(tiny_model) / name).read_bytes())
    script = Path(__file__).with_name("tool_stream_cases.py")
    proc = subprocess.run([str(ensure_vllm_cli().python), str(script), "qwen3_coder",
                           str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = json.loads(proc.stdout.splitlines()[-1])
    plan = ToolPlan("auto", QWEN3_TOOLS, parser="qwen3_coder")
    for case, streamed, (content, calls) in zip(QWEN3_CODER, theirs["streamed"],
                                                 theirs["whole"], strict=True):
        assert _ours(case, "qwen3_coder", QWEN3_TOOLS) == streamed, case
        ours_content, ours_calls = calls_in(plan, "".join(case))
        assert [ours_content, [[c.name, c.arguments] for c in ours_calls]] == \
            [content, calls], case
