"""The offline API takes vLLM's argument names: LLM(num_gpu_blocks_override=N) is the engine's
exact KV block count, as `--num-gpu-blocks-override` is for `shoal serve`."""

from __future__ import annotations

import pytest
from shoal.engine.llm import _engine_args


def test_num_gpu_blocks_override_is_the_kv_block_count():
    assert _engine_args({"num_gpu_blocks_override": 64, "block_size": 16}) == {
        "num_kv_blocks": 64, "block_size": 16}


def test_both_names_at_once_are_refused():
    with pytest.raises(TypeError, match="num_gpu_blocks_override and num_kv_blocks"):
        _engine_args({"num_gpu_blocks_override": 64, "num_kv_blocks": 32})
