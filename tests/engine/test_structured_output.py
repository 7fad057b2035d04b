"""Structured output at the engine level: generated JSON schemas, regexes and choices always
hold on a random-weight model (the grammar, not the model, guarantees the shape), a slow grammar
compile does not hold up other requests, and the bitmask sets exactly the allowed logits."""

from __future__ import annotations

import json
import random
import re
import threading

import jsonschema
import pytest
import torch
from shoal.engine import wire
from shoal.engine.structured.bitmask import apply_bitmask
from shoal.engine.wire import SamplingParams, StructuredOutputs

from .conftest import per_request


def random_schema(rng: random.Random) -> dict:
    """An object schema that always terminates: bounded strings, integers and arrays, enums."""
    def leaf(depth: int) -> dict:
        kind = rng.choice(["string", "integer", "boolean", "enum", "array"]
                          + (["object"] if depth < 1 else []))
        if kind == "string":
            return {"type": "string", "maxLength": rng.randint(1, 6)}
        if kind == "integer":
            lo = rng.randint(-50, 50)
            return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
        if kind == "boolean":
            return {"type": "boolean"}
        if kind == "enum":
            return {"enum": rng.sample(["red", "green", "blue", "cyan", 1, 2, True],
                                       rng.randint(1, 4))}
        if kind == "array":
            return {"type": "array", "items": rng.choice([{"type": "boolean"},
                                                          {"enum": ["a", "b"]}]),
                    "minItems": rng.randint(0, 1), "maxItems": rng.randint(1, 3)}
        return obj(depth + 1)

    def obj(depth: int) -> dict:
        names = rng.sample(["id", "name", "age", "ok", "tags", "kind", "meta", "n"],
                           rng.randint(1, 4))
        return {"type": "object", "properties": {n: leaf(depth) for n in names},
                "required": [n for n in names if rng.random() < 0.7],
                "additionalProperties": False}

    return obj(0)


@pytest.fixture(scope="module")
def llm(make_llm, tiny_model):
    return make_llm(tiny_model, max_num_seqs=64)


def constrained(kind: str, spec: str, seed: int, max_tokens: int = 160) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputs(kind, spec))


def test_fifty_generated_json_schemas_all_parse_and_validate(llm):
    rng = random.Random(1234)
    schemas = [random_schema(rng) for _ in range(50)]
    params = [constrained("json", json.dumps(s), seed=i) for i, s in enumerate(schemas)]
    outs = [o.outputs[0] for o in llm.generate(["Reply in JSON:"] * len(schemas), params)]
    for schema, out in zip(schemas, outs, strict=True):
        assert out.finish_reason == "stop", (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)


def test_regex_and_choice_outputs_always_match(llm):
    regexes = [r"[a-z]{2,5}-\d{3}", r"(yes|no|maybe)!", r"0x[0-9a-f]{4}", r"[A-Z][a-z]{0,4}"]
    choices = ["alpha", "beta gamma", "δ"]
    params = [constrained("regex", r, seed=i) for i, r in enumerate(regexes * 3)]
    params += [constrained("choice", json.dumps(choices), seed=i) for i in range(6)]
    outs = [o.outputs[0] for o in llm.generate(["x"] * len(params), params)]
    for p, out in zip(params, outs, strict=True):
        assert out.finish_reason == "stop", out.text
        if p.structured_outputs.kind == "regex":
            assert re.fullmatch(p.structured_outputs.spec, out.text), \
                (p.structured_outputs, out.text)
        else:
            assert out.text in choices


def test_unconstrained_requests_in_the_same_batch_are_untouched(llm):
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(["def main():"], plain)[0].outputs[0].token_ids
    mixed = llm.generate(["def main():", "y"],
                         [plain, constrained("regex", "[ab]{3}", seed=1)])
    assert mixed[0].outputs[0].token_ids == alone
    assert re.fullmatch("[ab]{3}", mixed[1].outputs[0].text)


def test_an_invalid_grammar_is_refused_at_add_request(llm):
    core = llm.client.engine_core
    req = wire.EngineCoreRequest("bad-regex", [1, 2, 3], constrained("regex", "a[", seed=0), 0.0)
    with pytest.raises(ValueError, match="(?s)invalid structured output.*unclosed character class"):
        core.add_request(req)


def test_a_slow_grammar_compile_does_not_stall_other_requests(llm):
    core = llm.client.engine_core
    manager = core.structured_output_manager
    release = threading.Event()
    real_compile = manager._compile

    def slow_compile(*args):
        assert release.wait(60)
        return real_compile(*args)

    manager._compile = slow_compile
    try:
        core.add_request(wire.EngineCoreRequest(
            "slow", [5, 6, 7], constrained("regex", "[xyz]{4}", seed=3), 0.0))
        core.add_request(wire.EngineCoreRequest(
            "plain", [5, 6, 7], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), 0.0))
        produced: dict[str, list[int]] = {"slow": [], "plain": []}
        finished = set()

        def step_until(rid: str, steps: int) -> None:
            for _ in range(steps):
                for o in per_request(core.step()):
                    produced[o.request_id] += o.new_token_ids
                    if o.finish_reason is not None:
                        finished.add(o.request_id)
                if rid in finished:
                    return

        step_until("plain", 50)
        assert "plain" in finished and len(produced["plain"]) == 8
        assert produced["slow"] == [] and core.scheduler.requests["slow"].grammar is not None
        release.set()
        step_until("slow", 200)
        assert re.fullmatch("[xyz]{4}", llm.tokenizer.decode(produced["slow"]))
    finally:
        release.set()
        manager._compile = real_compile


def test_apply_bitmask_keeps_exactly_the_allowed_tokens():
    vocab = 70
    allowed = {0: [0, 31, 32, 69], 2: [5]}
    words = torch.zeros(len(allowed), (vocab + 31) // 32, dtype=torch.int32)
    for row, ids in enumerate(allowed.values()):
        for t in ids:
            words[row, t // 32] |= torch.tensor(1 << (t % 32)).to(torch.int32)
    logits = torch.randn(3, vocab)
    before = logits.clone()
    apply_bitmask(logits, words.numpy().astype("<i4").tobytes(), list(allowed))
    for row, ids in allowed.items():
        finite = torch.isfinite(logits[row]).nonzero().flatten().tolist()
        assert finite == ids
        assert torch.equal(logits[row, ids], before[row, ids])
    assert torch.equal(logits[1], before[1])


def test_the_bitmask_travels_to_the_worker_ranks_in_the_scheduler_output():
    """Multi-rank executors send execute_model's SchedulerOutput as msgpack (worker_proc)."""
    import msgspec
    from shoal.engine.core.sched_output import SchedulerOutput
    from shoal.engine.executor.worker_proc import ARG_TYPES

    mask = bytes(range(16))
    out = SchedulerOutput(req_ids=["a", "b"], token_ids=[[1], [2]], start_positions=[3, 4],
                          block_ids=[[1], [2]], sample=[True, True],
                          grammar_req_ids=["b"], grammar_bitmask=mask)
    (back,) = msgspec.msgpack.decode(msgspec.msgpack.encode((out,)),
                                     type=ARG_TYPES["execute_model"])
    assert back.grammar_req_ids == ["b"] and back.grammar_bitmask == mask


def test_a_grammar_that_fails_to_compile_finishes_its_request_with_error(llm):
    core = llm.client.engine_core
    manager = core.structured_output_manager

    def failing_compile(*args):
        raise ValueError("grammar too large")

    manager._compile = failing_compile
    try:
        core.add_request(wire.EngineCoreRequest(
            "doomed", [5, 6, 7], constrained("regex", "[xyz]{4}", seed=3), 0.0))
        finishes = []
        for _ in range(100):
            finishes += [o.finish_reason for o in core.step().outputs
                         if o.finish_reason is not None]
            if finishes:
                break
        assert finishes == [wire.FinishReason.ERROR]
    finally:
        del manager._compile
