"""deepseek_r1's and qwen3's splits, whole and streamed, are vLLM 0.32's: the same token
streams through vLLM's own DeepSeekR1ReasoningParser / Qwen3Parser (in the cached vLLM venv,
support.vllm_cli) and ours."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from reasoning_cases import CASES, QWEN3_CASES, resolve
from shoal.engine.entrypoints.reasoning import ReasoningParser
from shoal.engine.tokenizer import load_tokenizer
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


def test_qwen3_splits_as_vllms_parser(tiny_model, tmp_path):
    from tokenizers import AddedToken, Tokenizer

    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "config.json"):
        if (Path(tiny_model) / name).exists():
            (tmp_path / name).write_bytes((Path(tiny_model) / name).read_bytes())
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    tok.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    tok.save(str(tmp_path / "tokenizer.json"))
    script = Path(__file__).with_name("reasoning_cases.py")
    proc = subprocess.run([str(ensure_vllm_cli().python), str(script), "qwen3", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours_tok = load_tokenizer(str(tmp_path))
    parser = ReasoningParser.load("qwen3", ours_tok)
    for case, theirs in zip(QWEN3_CASES, json.loads(proc.stdout), strict=True):
        stream = parser.stream()
        ours = [stream.feed(text, ours_tok(text, add_special_tokens=False).input_ids)
                for text in case]
        assert ours == theirs["deltas"], case
        assert list(parser.split("".join(case))) == theirs["whole"], case
