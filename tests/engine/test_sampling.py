"""Sampling parameters: the sampler's arithmetic on known logits, and their effect end to end."""

from __future__ import annotations

import pytest
import torch
from shoal.engine import wire
from shoal.engine.worker.input_batch import CachedRequestState, build_sampling_metadata
from shoal.engine.worker.sampler import apply_penalties, sample


def metadata(params: list[wire.SamplingParams], outputs=None, prompts=None, vocab=6):
    states = []
    for i, p in enumerate(params):
        gen = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
        states.append(CachedRequestState(f"r{i}", (prompts or [[]] * len(params))[i], p, 0, gen,
                                         list((outputs or [[]] * len(params))[i])))
    return build_sampling_metadata(states, vocab, torch.device("cpu"))


LOGITS = torch.tensor([[1.0, 3.0, 2.0, 0.5, -1.0, 2.9]])


@pytest.mark.parametrize(
    "params, allowed",
    [
        (dict(temperature=0.0), {1}),
        (dict(temperature=1.0, top_k=1), {1}),
        (dict(temperature=1.0, top_k=2), {1, 5}),
        (dict(temperature=1.0, top_p=0.01), {1}),
        (dict(temperature=1.0, min_p=0.9), {1, 5}),  # 2.9 is within 0.9x of the top prob
        (dict(temperature=1.0, min_p=0.95), {1}),
    ],
)
def test_truncation_keeps_only_the_allowed_tokens(params, allowed):
    seen = set()
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        seen.add(int(sample(LOGITS.clone(), metadata([wire.SamplingParams(**params)]), gen)))
    assert seen == allowed


def test_penalties_follow_vllm_semantics():
    p = wire.SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    m = metadata([p], outputs=[[1, 1, 4]], prompts=[[2]])
    out = apply_penalties(LOGITS.clone(), m)[0]
    assert out[0] == pytest.approx(1.0)  # untouched
    assert out[1] == pytest.approx(3.0 / 2 - 0.5 * 2 - 0.25)  # seen twice in the output
    assert out[2] == pytest.approx(2.0 / 2)  # prompt token: repetition penalty only
    assert out[4] == pytest.approx(-1.0 * 2 - 0.5 - 0.25)  # negative logit is multiplied


def test_min_tokens_bans_stop_tokens_until_met():
    p = wire.SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[5])
    m = metadata([p], outputs=[[3]])
    # eos (id 0 in metadata()) and stop id 5 lead the logits but are banned for now:
    logits = torch.tensor([[9.0, 1.0, 1.0, 1.0, 1.0, 8.0]])
    assert int(sample(logits.clone(), m)) not in (0, 5)
    done = metadata([p], outputs=[[3, 3]])
    assert int(sample(logits.clone(), done)) == 0


def test_seeded_rows_are_reproducible_whatever_the_batch():
    p = wire.SamplingParams(temperature=1.0, seed=1234)
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1))
    draws = []
    for batch in (1, 3):
        m = metadata([p] + [wire.SamplingParams(temperature=1.0)] * (batch - 1), vocab=50)
        rows = logits.repeat(batch, 1)
        draws.append([int(sample(rows.clone(), m)[0]) for _ in range(5)])
    assert draws[0] == draws[1]


@pytest.fixture(scope="module")
def llm(make_llm, tiny_model):
    return make_llm(tiny_model, max_model_len=256)


PROMPTS = [[40, 41, 42, 43], [500, 600, 700], [1000 + i for i in range(20)]]


def test_seed_makes_sampling_reproducible(llm):
    params = wire.SamplingParams(temperature=1.0, seed=42, max_tokens=16, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    again = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[::-1], params)][::-1]
    assert first == again
    other = llm.generate(PROMPTS, wire.SamplingParams(temperature=1.0, seed=7, max_tokens=16,
                                                      ignore_eos=True))
    assert [o.outputs[0].token_ids for o in other] != first


def test_max_tokens_and_length_finish(llm):
    outs = llm.generate(PROMPTS, wire.SamplingParams(temperature=0.0, max_tokens=5,
                                                     ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 5 and o.outputs[0].finish_reason == "length"
               for o in outs)


def test_stop_token_ids_and_min_tokens(llm):
    greedy = llm.generate(PROMPTS[0], wire.SamplingParams(temperature=0.0, max_tokens=6,
                                                          ignore_eos=True))[0].outputs[0].token_ids
    stop = greedy[2]
    out = llm.generate(PROMPTS[0], wire.SamplingParams(
        temperature=0.0, max_tokens=6, stop_token_ids=[stop], ignore_eos=True))[0].outputs[0]
    assert out.token_ids == greedy[:3] and out.finish_reason == "stop" and out.stop_reason == stop
    first = greedy[0]
    held = llm.generate(PROMPTS[0], wire.SamplingParams(
        temperature=0.0, max_tokens=6, min_tokens=3, stop_token_ids=[first],
        ignore_eos=True))[0].outputs[0]
    assert len(held.token_ids) >= 3 and held.token_ids[0] != first


def test_generation_stops_at_the_context_length(make_llm, tiny_model):
    llm = make_llm(tiny_model, max_model_len=32)
    out = llm.generate([list(range(100, 128))], wire.SamplingParams(temperature=0.0,
                                                                    max_tokens=None,
                                                                    ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


def test_bad_prompt_in_a_batch_submits_nothing_and_the_engine_keeps_working(llm):
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate([[5, 6], list(range(5, 5 + 300))], wire.SamplingParams(max_tokens=2))
    assert not llm.engine_core.has_unfinished_requests()
    two = llm.generate([[5, 6]], wire.SamplingParams(max_tokens=2))[0].outputs[0]
    assert len(two.token_ids) == 2
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate([[5, 6]], wire.SamplingParams(max_tokens=0))
