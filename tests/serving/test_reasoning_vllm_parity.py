"""deepseek_r1's split, whole and streamed, is vLLM 0.32's: the same token streams through
vLLM's own DeepSeekR1ReasoningParser (in the cached vLLM venv, support.vllm_cli) and ours."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from reasoning_cases import CASES, resolve
from shoal.engine.entrypoints.reasoning import ReasoningParser
from support.vllm_cli import ensure_vllm_cli

pytestmark = pytest.mark.process
START, END = 900, 901


def test_deepseek_r1_splits_as_vllms_parser():
    script = Path(__file__).with_name("reasoning_cases.py")
    proc = subprocess.run([str(ensure_vllm_cli().python), str(script), str(START), str(END)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    vllm = json.loads(proc.stdout)
    parser = ReasoningParser("deepseek_r1", START, END)
    for case, theirs in zip(CASES, vllm, strict=True):
        stream = parser.stream()
        ours = [stream.feed(text, ids) for text, ids in resolve(case, START, END)]
        assert ours == theirs["deltas"], case
        assert list(parser.split("".join(t for t, _ in case))) == theirs["whole"], case
