"""`from shoal.engine import LLM, SamplingParams` as `from vllm import ...`: vLLM's offline
example runs unchanged but for the import and the model path, outputs have vLLM's shapes, n > 1
fans out as the server does, and vLLM arguments the engine does not implement are named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from shoal.engine import LLM, SamplingParams

EXAMPLE = Path(__file__).parents[2] / "examples" / "offline_inference.py"


@pytest.fixture(scope="module")
def llm(make_llm, tiny_model):
    return make_llm(tiny_model, max_model_len=256, dtype="float32")  # exact logprob checks


@pytest.mark.process  # a child process
def test_vllm_basic_example_runs_and_prints_each_prompt_and_output(tiny_model):
    env = {**os.environ, "SHOAL_KV_CACHE_SPACE": "0.0625", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, str(EXAMPLE), tiny_model], capture_output=True,
                         text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("Prompt:    ") == 4 and run.stdout.count("Output:    ") == 4
    assert "Prompt:    'The capital of France is'" in run.stdout


def test_outputs_have_vllm_shapes(llm):
    out = llm.generate(["def main(", [5, 6, 7]], SamplingParams(temperature=0, max_tokens=5,
                                                                 ignore_eos=True))
    text, ids = out
    assert text.prompt == "def main("
    assert text.prompt_token_ids == llm.tokenizer("def main(").input_ids
    assert ids.prompt is None and ids.prompt_token_ids == [5, 6, 7]
    assert text.request_id != ids.request_id and text.finished and ids.finished
    (c,) = text.outputs
    assert c.index == 0 and len(c.token_ids) == 5 and c.finish_reason == "length"
    # Incremental detokenization, as the server's: an unfinished UTF-8 sequence at the end is
    # held back rather than shown as U+FFFD.
    assert c.text == llm.tokenizer.decode(c.token_ids, skip_special_tokens=True).rstrip("\ufffd")
    assert c.cumulative_logprob is None and c.logprobs is None and c.stop_reason is None
    as_dict = llm.generate({"prompt_token_ids": [5, 6, 7]},
                           SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert as_dict[0].outputs[0].token_ids == ids.outputs[0].token_ids


def test_n_choices_step_the_seed_as_the_server_does(llm):
    sampled = llm.generate("x = ", SamplingParams(temperature=1.0, max_tokens=8, n=2, seed=11,
                                                  ignore_eos=True))[0].outputs
    assert [c.index for c in sampled] == [0, 1]
    alone = [llm.generate("x = ", SamplingParams(temperature=1.0, max_tokens=8, seed=s,
                                                 ignore_eos=True))[0].outputs[0].token_ids
             for s in (11, 12)]
    assert [c.token_ids for c in sampled] == alone and alone[0] != alone[1]


def test_stop_strings_cut_the_text_as_the_server_does(llm):
    free = llm.generate("def main(", SamplingParams(temperature=0, max_tokens=12,
                                                    ignore_eos=True))[0].outputs[0]
    stop = free.text[3:5]
    cut = llm.generate("def main(", SamplingParams(temperature=0, max_tokens=12, stop=[stop],
                                                   ignore_eos=True))[0].outputs[0]
    assert cut.text == free.text[:free.text.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop


def test_a_stop_string_given_alone_stops_at_the_string(llm):
    """vLLM's `SamplingParams(stop="Question:")`: the string, not each of its characters."""
    free = llm.generate("def main(", SamplingParams(temperature=0, max_tokens=12,
                                                    ignore_eos=True))[0].outputs[0]
    # A string one of whose characters comes earlier: iterated, it would cut there.
    stop = next(free.text[k:k + 3] for k in range(1, len(free.text) - 3)
                if any(c in free.text[:free.text.index(free.text[k:k + 3])]
                       for c in free.text[k:k + 3]))
    cut = llm.generate("def main(", SamplingParams(temperature=0, max_tokens=12, stop=stop,
                                                   stop_token_ids=None,
                                                   ignore_eos=True))[0].outputs[0]
    assert cut.text == free.text[:free.text.index(stop)] and cut.stop_reason == stop


def _with_generation_config(model: str, tmp_path, config: dict) -> str:
    """The model's files, linked, beside a generation_config.json of our own."""
    copy = tmp_path / "model"
    copy.mkdir()
    for f in Path(model).iterdir():
        if f.name != "generation_config.json":
            (copy / f.name).symlink_to(f)
    (copy / "generation_config.json").write_text(json.dumps(config))
    return str(copy)


def test_the_models_generation_config_is_the_default_of_a_call_without_params(
        make_llm, tiny_model, tmp_path):
    model = _with_generation_config(tiny_model, tmp_path, {"eos_token_id": [1, 4],
                                                           "temperature": 0.0,
                                                           "max_new_tokens": 5})
    llm = make_llm(model, max_model_len=256, dtype="float32")
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=5)
    out = llm.generate("def main(")[0].outputs[0]  # vLLM's: the model's defaults
    greedy = llm.generate("def main(", SamplingParams(temperature=0, max_tokens=5))[0].outputs[0]
    assert out.token_ids == greedy.token_ids and len(out.token_ids) <= 5
    plain = make_llm(model, max_model_len=256, dtype="float32", generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()


def test_chat_renders_the_template_and_generates(llm):
    messages = [{"role": "user", "content": "hi"}]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    (chat,) = llm.chat(messages, params)
    ids = llm.input_processor.render_chat(messages)
    assert chat.prompt_token_ids == ids and "hi" in chat.prompt
    assert chat.outputs[0].token_ids == llm.generate([ids], params)[0].outputs[0].token_ids


def test_vllm_arguments_this_engine_lacks_are_named(tiny_model):
    with pytest.raises(TypeError, match="quantization, swap_space"):
        LLM(model=tiny_model, swap_space=4, quantization="awq", enforce_eager=True)
    with pytest.raises(TypeError, match="trust_remote_code=True"):
        LLM(model=tiny_model, trust_remote_code=True)


def test_logprobs_come_in_vllms_offline_shape_and_equal_the_models(llm, tiny_model):
    import torch
    from transformers import AutoModelForCausalLM

    prompt = [5, 17, 99, 230, 41]
    (out,) = llm.generate({"prompt_token_ids": prompt},
                          SamplingParams(temperature=0, max_tokens=3, ignore_eos=True,
                                         logprobs=2, prompt_logprobs=1))
    (c,) = out.outputs
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + c.token_ids])).logits[0].float().log_softmax(-1)
    assert len(c.logprobs) == 3 and len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None
    for i, tok in enumerate(c.token_ids):  # greedy: the chosen token is rank 1, 2 alternatives
        d = c.logprobs[i]
        assert d[tok].rank == 1 and len(d) == 2 and d[tok].decoded_token is not None
        assert abs(d[tok].logprob - ref[len(prompt) - 1 + i, tok].item()) < 1e-3
    assert abs(c.cumulative_logprob - sum(c.logprobs[i][t].logprob
                                          for i, t in enumerate(c.token_ids))) < 1e-6
    for p in range(1, len(prompt)):  # the prompt token's own logprob, and one alternative
        d = out.prompt_logprobs[p]
        assert abs(d[prompt[p]].logprob - ref[p - 1, prompt[p]].item()) < 1e-3
        assert 1 <= len(d) <= 2


def test_priority_under_fcfs_is_refused_in_vllms_words_before_anything_runs(llm):
    greedy = SamplingParams(temperature=0, max_tokens=3)
    with pytest.raises(ValueError, match=r"^Got priority 1 but Priority scheduling is not "
                                         r"enabled\.$"):
        llm.generate(["def main(", "import"], greedy, priority=[0, 1])
    assert not llm.engine_core.has_unfinished_requests()
    assert len(llm.generate("def main(", greedy, priority=0)) == 1  # 0 is every request's


def test_priority_policy_serves_lower_priority_values_first(make_llm, tiny_model, llm):
    from shoal.engine import wire

    pri = make_llm(tiny_model, max_model_len=256, dtype="float32", max_num_seqs=1,
                   scheduling_policy="priority")
    greedy = SamplingParams(temperature=0, max_tokens=4)
    prompts = ["def main(", "import", "class A"]
    # The same texts as first come, first served: the order changes, not the answers.
    assert ([o.outputs[0].text for o in pri.generate(prompts, greedy, priority=[2, 0, 1])]
            == [o.outputs[0].text for o in llm.generate(prompts, greedy)])
    with pytest.raises(ValueError, match=r"lengths of prompts \(3\) and priority \(2\) must be"):
        pri.generate(prompts, greedy, priority=[1, 2])
    # One seat: the engine finishes them in priority order (then arrival), not as they came.
    core = pri.engine_core
    for rid, prio in [("late-2", 2), ("low-0", 0), ("mid-1", 1), ("low-0b", 0)]:
        ids = pri.tokenizer("def main(").input_ids
        core.add_request(wire.EngineCoreRequest(rid, ids, wire.SamplingParams(
            temperature=0, max_tokens=2), 0.0, priority=prio))
    finished = []
    while core.has_unfinished_requests():
        finished += [o.request_id for o in core.step().outputs if o.finish_reason is not None]
    assert finished == ["low-0", "low-0b", "mid-1", "late-2"]


# ----- SamplingParams checked at construction, as vLLM 0.32's --------------------------------

REFUSED_PARAMS = [  # (arguments, vLLM's message)
    (dict(n=0), "n must be at least 1, got 0."),
    (dict(n=1.5), "n must be an int, but is of type <class 'float'>"),
    (dict(n=20000), "n must be at most 16384, got 20000. To increase this limit, set the "
                    "VLLM_MAX_N_SEQUENCES environment variable."),
    (dict(temperature=0, n=2), "n must be 1 when using greedy sampling, got 2."),
    (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2], got 2.5."),
    (dict(frequency_penalty=-3), "frequency_penalty must be in [-2, 2], got -3."),
    (dict(repetition_penalty=float("inf")), "repetition_penalty must be a finite number, got inf."),
    (dict(repetition_penalty=0), "repetition_penalty must be greater than zero, got 0."),
    (dict(temperature=float("nan")), "temperature must be a finite number, got nan."),
    (dict(temperature=-0.5), "temperature must be non-negative, got -0.5."),
    (dict(temperature=2.5), "temperature must be in [0, 2], got 2.5."),
    (dict(top_p=0), "top_p must be in (0, 1], got 0."),
    (dict(top_p=1.2), "top_p must be in (0, 1], got 1.2."),
    (dict(top_k=-2), "top_k must be 0 (disable), or at least 1, got -2."),
    (dict(top_k=2.5), "top_k must be an integer, got float"),
    (dict(min_p=1.5), "min_p must be in [0, 1], got 1.5."),
    (dict(max_tokens=0), "max_tokens must be at least 1, got 0."),
    (dict(min_tokens=-1), "min_tokens must be greater than or equal to 0, got -1."),
    (dict(min_tokens=5, max_tokens=4), "min_tokens must be less than or equal to max_tokens=4, "
                                       "got 5."),
    (dict(logprobs=-2), "logprobs must be non-negative or -1, got -2."),
    (dict(prompt_logprobs=-3), "prompt_logprobs must be non-negative or -1, got -3."),
    (dict(stop_token_ids=[1, "2"]), "stop_token_ids must contain only integers, got [1, '2']."),
    (dict(stop=["a", ""]), "stop cannot contain an empty string."),
]


@pytest.mark.parametrize("args, message", REFUSED_PARAMS, ids=[m[:30] for _, m in REFUSED_PARAMS])
def test_sampling_params_refuse_what_vllm_refuses_in_its_words(args, message):
    with pytest.raises(ValueError) as err:
        SamplingParams(**args)
    assert str(err.value) == message


CONVERTED_PARAMS = [  # (arguments, the fields as vLLM leaves them)
    (dict(seed=-1), dict(seed=None)),
    (dict(stop="Question:"), dict(stop=["Question:"])),
    (dict(stop=None, stop_token_ids=None), dict(stop=[], stop_token_ids=[])),
    (dict(stop_token_ids=[3, 2, 3]), dict(stop_token_ids=[3, 2])),
    (dict(logprobs=True, prompt_logprobs=True), dict(logprobs=1, prompt_logprobs=1)),
    (dict(temperature=0.001), dict(temperature=0.01)),
    (dict(temperature=0, top_p=0.5, top_k=3, min_p=0.2), dict(top_p=1.0, top_k=0, min_p=0.0)),
    (dict(temperature=0.7, top_p=0.5, top_k=-1), dict(top_p=0.5, top_k=-1)),
    (dict(logprobs=-1), dict(logprobs=-1)),  # vLLM's whole vocabulary (the engine refuses it)
]


@pytest.mark.parametrize("args, fields", CONVERTED_PARAMS,
                         ids=[str(a) for a, _ in CONVERTED_PARAMS])
def test_sampling_params_convert_their_fields_as_vllm(args, fields):
    p = SamplingParams(**args)
    assert {k: getattr(p, k) for k in fields} == fields


def test_sampling_params_are_the_wire_struct_and_the_default_params_are_checked(llm):
    from shoal.engine import wire

    assert isinstance(SamplingParams(), wire.SamplingParams)
    assert type(llm.get_default_sampling_params()) is SamplingParams
