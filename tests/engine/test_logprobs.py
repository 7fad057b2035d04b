"""Logprobs oracle: the engine's logprobs equal transformers' float32 log_softmax of the same
model's logits, for sampled tokens (raw model distribution: before temperature and penalties)
and for prompt tokens across chunked prefill, a prefix-cache hit and preemption."""

from __future__ import annotations

import time
from collections import defaultdict

import msgspec
import pytest
import torch
from shoal.engine import wire
from shoal.engine.codec import OutputCodec
from shoal.engine.frontend.logprobs import unpack

from .conftest import per_request

TOL = 1e-3
RANK_BAND = 1e-4


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(make_engine, tiny_model):
    # A 16-token budget: every prompt below is prefilled in several chunks.
    return make_engine(tiny_model, dtype="float32", max_num_batched_tokens=16, block_size=16)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(5, 8192, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference(hf_model, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V] log_softmax: row p is the distribution of token p + 1."""
    with torch.inference_mode():
        return hf_model(torch.tensor([tokens])).logits[0].float().log_softmax(-1)


def run(core, requests: list[wire.EngineCoreRequest], preemptions: list | None = None
        ) -> dict[str, list[wire.EngineCoreOutput]]:
    for r in requests:
        core.add_request(r)
    outs: dict[str, list[wire.EngineCoreOutput]] = defaultdict(list)
    while core.has_unfinished_requests():
        step = core.step()
        for o in per_request(step):
            outs[o.request_id].append(o)
        if preemptions is not None and step.scheduler_stats is not None:
            preemptions.append(step.scheduler_stats.num_preemptions)
    return outs


def request(rid: str, tokens: list[int], **params) -> wire.EngineCoreRequest:
    params.setdefault("ignore_eos", True)
    return wire.EngineCoreRequest(rid, tokens, wire.SamplingParams(**params), time.time())


def positions(lp: wire.Logprobs):
    return unpack(lp, str)


def check_position(pos, ref_row: torch.Tensor, chosen: int, n: int) -> None:
    assert pos.token_id == chosen
    assert abs(pos.logprob - ref_row[chosen].item()) < TOL
    # The rank counts the engine's own values, which differ from the reference's by float32
    # rounding (another GEMM): a token within RANK_BAND of the chosen one may fall either side.
    value = ref_row[chosen]
    assert int((ref_row > value + RANK_BAND).sum()) < pos.rank <= int(
        (ref_row >= value - RANK_BAND).sum())
    top = ref_row.topk(n)
    assert len(pos.token_ids) == 1 + n
    assert torch.allclose(torch.tensor(pos.logprobs[1:]), top.values, atol=TOL)
    for got, want, value in zip(pos.token_ids[1:], top.indices.tolist(), top.values, strict=True):
        # a different order is only allowed between near-equal values
        assert got == want or abs(ref_row[got] - value) < TOL


def test_sampled_tokens_carry_the_raw_models_logprobs(engine, hf_model):
    p = prompt(40, 1)
    outs = run(engine, [
        request("greedy", p, temperature=0.0, max_tokens=6, logprobs=5),
        # Sampling settings change what is drawn, never the reported (raw) distribution.
        request("hot", p, temperature=1.7, top_k=50, repetition_penalty=1.5, seed=3,
                max_tokens=6, logprobs=2),
        request("none", p, temperature=0.0, max_tokens=6),
    ])
    for rid, n in (("greedy", 5), ("hot", 2)):
        tokens = [t for o in outs[rid] for t in o.new_token_ids]
        lps = [pos for o in outs[rid] for pos in positions(o.new_logprobs)]
        assert len(tokens) == len(lps) == 6
        ref = reference(hf_model, p + tokens)
        for k, (token, pos) in enumerate(zip(tokens, lps, strict=True)):
            check_position(pos, ref[len(p) - 1 + k], token, n)
    assert all(lp.rank == 1 for o in outs["greedy"] for lp in positions(o.new_logprobs))
    assert all(o.new_logprobs is None and o.new_prompt_logprobs is None for o in outs["none"])


def test_prompt_logprobs_span_every_chunk_of_a_chunked_prefill(engine, hf_model):
    p = prompt(53, 2)  # 4 chunks of the 16-token budget
    outs = run(engine, [request("plp", p, temperature=0.0, max_tokens=2, prompt_logprobs=3)])
    first = outs["plp"][0]
    assert first.new_prompt_logprobs is not None
    assert all(o.new_prompt_logprobs is None for o in outs["plp"][1:])
    rows = positions(first.new_prompt_logprobs)
    assert len(rows) == len(p) - 1
    ref = reference(hf_model, p)
    for j, pos in enumerate(rows):
        check_position(pos, ref[j], p[j + 1], 3)


def test_prompt_logprobs_are_whole_after_a_prefix_cache_hit(engine, hf_model):
    p = prompt(40, 3)
    run(engine, [request("warm", p, temperature=0.0, max_tokens=1)])  # caches 2 full blocks
    outs = run(engine, [request("again", p, temperature=0.0, max_tokens=1, prompt_logprobs=0)])
    first = outs["again"][0]
    assert first.num_cached_tokens == 0  # no hit: every prompt position's logits are needed
    rows = positions(first.new_prompt_logprobs)
    ref = reference(hf_model, p)
    assert len(rows) == len(p) - 1
    for j, pos in enumerate(rows):
        check_position(pos, ref[j], p[j + 1], 0)


def test_a_one_token_prompt_has_no_prompt_positions(engine):
    outs = run(engine, [request("one", [7], temperature=0.0, max_tokens=1, prompt_logprobs=2)])
    assert positions(outs["one"][0].new_prompt_logprobs) == []


def test_prompt_logprobs_survive_preemption(make_engine, tiny_model, hf_model):
    # 6 usable blocks of 16: two 40-token requests growing to 88 tokens cannot both fit.
    core = make_engine(tiny_model, dtype="float32", max_num_batched_tokens=32, block_size=16,
                       num_kv_blocks=7, max_model_len=96)
    a, b = prompt(40, 4), prompt(40, 5)
    preemptions: list[int] = []
    outs = run(core, [request("a", a, temperature=0.0, max_tokens=48, prompt_logprobs=1,
                              logprobs=1),
                      request("b", b, temperature=0.0, max_tokens=48, prompt_logprobs=1)],
               preemptions)
    assert sum(preemptions) > 0
    for rid, p in (("a", a), ("b", b)):
        firsts = [o for o in outs[rid] if o.new_prompt_logprobs is not None]
        assert len(firsts) == 1  # once, even if a preemption recomputed the prompt
        rows = positions(firsts[0].new_prompt_logprobs)
        ref = reference(hf_model, p)
        assert len(rows) == len(p) - 1
        for j, pos in enumerate(rows):
            check_position(pos, ref[j], p[j + 1], 1)
    tokens = [t for o in outs["a"] for t in o.new_token_ids]
    assert len([pos for o in outs["a"] for pos in positions(o.new_logprobs)]) == len(tokens)


def test_outputs_with_logprobs_cross_the_wire_whole(engine):
    p = prompt(20, 6)
    engine.add_request(request("w", p, temperature=0.0, max_tokens=3, logprobs=2,
                               prompt_logprobs=1))
    engine.add_request(request("plain", p, temperature=0.0, max_tokens=3))
    seen = []
    while engine.has_unfinished_requests():
        step = engine.step()
        assert "w" not in step.decode_req_ids  # never a bare column entry
        handles = {"w": 1, "plain": 2}
        raw = msgspec.msgpack.encode(OutputCodec.pack(step, handles.get))
        back = OutputCodec.unpack(msgspec.msgpack.decode(raw, type=wire.OutputBatch),
                                  {1: "w", 2: "plain"})
        seen += [o for o in back.outputs if o.request_id == "w"]
    assert len(seen) == 3
    assert all(len(positions(o.new_logprobs)) == 1 for o in seen)
    assert len(positions(seen[0].new_prompt_logprobs)) == len(p) - 1


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value, message", [(-1, "must be non-negative"),
                                            (21, "must be between 0 and 20 .max_logprobs.")])
def test_out_of_range_counts_are_refused_naming_the_field(engine, field, value, message):
    with pytest.raises(ValueError, match=f"{field} {message}"):
        engine.add_request(request("bad", [1, 2], **{field: value}))


@pytest.mark.process  # a child process
def test_a_tensor_parallel_group_reports_the_same_logprobs(make_engine, tiny_model, hf_model):
    # Rank 0 alone computes logprobs; its ModelRunnerOutput crosses the worker reply socket.
    core = make_engine(tiny_model, dtype="float32", max_num_batched_tokens=16,
                       tensor_parallel_size=2)
    p = prompt(30, 7)
    outs = run(core, [request("tp", p, temperature=0.0, max_tokens=3, logprobs=2,
                              prompt_logprobs=2)])
    tokens = [t for o in outs["tp"] for t in o.new_token_ids]
    ref = reference(hf_model, p + tokens)
    rows = positions(outs["tp"][0].new_prompt_logprobs)
    rows += [pos for o in outs["tp"] for pos in positions(o.new_logprobs)]
    assert len(rows) == len(p) - 1 + len(tokens)
    for j, pos in enumerate(rows):
        check_position(pos, ref[j], (p + tokens)[j + 1], 2)
