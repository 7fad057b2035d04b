"""The model's generation_config.json sampling defaults (vLLM's get_diff_sampling_param), and
SamplingParams' offline forms (vLLM's `stop="..."`, `None` lists)."""

from __future__ import annotations

import json

import pytest
from shoal.engine import generation_config, wire


@pytest.mark.parametrize("config, defaults", [
    ({}, {}),
    ({"bos_token_id": 0, "eos_token_id": [1, 4]}, {}),  # the project's models: nothing to apply
    ({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True},
     {"temperature": 0.6, "top_p": 0.95, "top_k": 20}),
    ({"max_new_tokens": 64, "repetition_penalty": 1.05, "min_p": 0.0},
     {"max_tokens": 64, "repetition_penalty": 1.05, "min_p": 0.0}),
    ({"temperature": None, "presence_penalty": 0.5, "frequency_penalty": 0.1},
     {"presence_penalty": 0.5, "frequency_penalty": 0.1}),
    ({"max_length": 100, "num_beams": 1}, {}),  # not sampling values vLLM takes
])
def test_sampling_values_of_a_generation_config(config, defaults):
    assert generation_config.diff_sampling_params(config) == defaults


def test_the_source_decides_where_the_file_is_read(tmp_path):
    model, other = tmp_path / "model", tmp_path / "other"
    for d, t in ((model, 0.7), (other, 0.2)):
        d.mkdir()
        (d / "generation_config.json").write_text(json.dumps({"temperature": t}))
    assert generation_config.sampling_defaults(str(model)) == {"temperature": 0.7}
    assert generation_config.sampling_defaults(str(model), "vllm") == {}
    assert generation_config.sampling_defaults(str(model), str(other)) == {"temperature": 0.2}
    assert generation_config.sampling_defaults(str(tmp_path)) == {}  # no file: nothing
    with pytest.raises(ValueError, match="no generation_config.json"):
        generation_config.sampling_defaults(str(model), str(tmp_path))
    (model / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not readable JSON"):
        generation_config.sampling_defaults(str(model))


def test_the_start_up_line_names_every_value_applied():
    line = generation_config.describe({"temperature": 0.6, "max_tokens": 64})
    assert "generation_config.json" in line and "temperature=0.6" in line
    assert "max_tokens=64" in line and "--generation-config vllm" in line


@pytest.mark.parametrize("kwargs, stop, stop_ids", [
    (dict(stop="Question:"), ["Question:"], []),  # one string, not its characters
    (dict(stop=None, stop_token_ids=None), [], []),
    (dict(stop=["a", "b"], stop_token_ids=[7]), ["a", "b"], [7]),
])
def test_sampling_params_take_vllms_offline_stop_forms(kwargs, stop, stop_ids):
    p = wire.SamplingParams(**kwargs)
    assert p.stop == stop and p.stop_token_ids == stop_ids
    p.verify()
