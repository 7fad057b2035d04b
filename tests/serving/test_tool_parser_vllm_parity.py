"""hermes under tool_choice "auto" streams as vLLM 0.32 streams it: the same deltas through
vLLM's own Hermes2ProToolParser (in the cached vLLM venv, support.vllm_cli) and through
ToolCallStream give the same content pieces, names and argument fragments, and the arguments
stream as they arrive, not only when the block closes."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from shoal.engine.entrypoints.tool_calls import ToolPlan
from shoal.engine.entrypoints.tool_parsers import ToolCallStream
from support.vllm_cli import ensure_vllm_cli
from tool_stream_cases import CALL, CASES, events

pytestmark = pytest.mark.process


def _ours(case: list[str]) -> list:
    stream = ToolCallStream(ToolPlan("auto", []))
    deltas = []
    for n, piece in enumerate(case):
        deltas += stream.feed(piece, final=n == len(case) - 1)
    return events(deltas)


def test_hermes_streams_as_vllms_parser():
    script = Path(__file__).with_name("tool_stream_cases.py")
    proc = subprocess.run([str(ensure_vllm_cli().python), str(script)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for case, theirs in zip(CASES, json.loads(proc.stdout), strict=True):
        assert _ours(case) == theirs, case


def test_hermes_arguments_stream_before_the_block_closes():
    stream = ToolCallStream(ToolPlan("auto", []))
    stream.feed(CALL[:40])
    sent = stream.feed(CALL[40:60])
    assert any((c.get("function") or {}).get("arguments") for d in sent
               for c in d.get("tool_calls", []))
    assert "</tool_call>" not in CALL[:60]
