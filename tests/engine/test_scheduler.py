"""Scheduler unit tests: no model, a hand-fed runner output after every step."""

from __future__ import annotations

import pytest
from shoal.engine import wire
from shoal.engine.core.request import Request, RequestStatus
from shoal.engine.core.sched_output import ModelRunnerOutput
from shoal.engine.core.scheduler import Scheduler

from .conftest import per_request


def make_scheduler(**kw) -> Scheduler:
    args = dict(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                max_model_len=256, enable_prefix_caching=False)
    args.update(kw)
    return Scheduler(**args)


def make_request(rid: str, num_tokens: int, max_tokens: int = 4, first_token: int = 100) -> Request:
    params = wire.SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return Request(rid, list(range(first_token, first_token + num_tokens)), params, max_tokens)


def run_step(sched: Scheduler, token: int = 7):
    """Schedule, then pretend the model sampled `token` for every row that samples; the step's
    outputs in per-request form."""
    out = sched.schedule()
    sampled = {r: token for r, s in zip(out.req_ids, out.sample, strict=True) if s}
    step = sched.update_from_output(out, ModelRunnerOutput(sampled))
    return out, per_request(step)


def assert_all_blocks_free(sched: Scheduler) -> None:
    pool = sched.kv.pool
    assert pool.num_free_blocks == pool.num_blocks - 1
    assert not sched.kv.req_blocks


@pytest.mark.parametrize(
    "budget, prompt_lens, expected_first_step",
    [
        (64, [10, 10, 10], {"a": 10, "b": 10, "c": 10}),  # everything fits
        (16, [10, 10, 10], {"a": 10, "b": 6}),  # budget runs out: b is chunked, c waits
        (10, [10, 10], {"a": 10}),  # exactly one prompt
        (4, [10], {"a": 4}),  # a long prompt is chunked
    ],
)
def test_first_step_respects_the_token_budget(budget, prompt_lens, expected_first_step):
    sched = make_scheduler(max_num_batched_tokens=budget)
    for rid, n in zip("abc", prompt_lens, strict=False):
        sched.add_request(make_request(rid, n))
    out = sched.schedule()
    assert out.num_scheduled_tokens == expected_first_step
    assert out.total_num_scheduled_tokens <= budget


def test_seats_limit_running_requests():
    sched = make_scheduler(max_num_seqs=2)
    for rid in "abc":
        sched.add_request(make_request(rid, 5))
    out, _ = run_step(sched)
    assert out.req_ids == ["a", "b"]
    assert [r.request_id for r in sched.waiting] == ["c"]


def test_chunked_prefill_samples_only_after_the_last_chunk():
    sched = make_scheduler(max_num_batched_tokens=16)
    sched.add_request(make_request("a", 40, max_tokens=2))
    chunks, sampled = [], []
    while sched.has_unfinished_requests():
        out, outputs = run_step(sched)
        chunks.append((out.start_positions[0], len(out.token_ids[0]), out.sample[0]))
        sampled.extend(t for o in outputs for t in o.new_token_ids)
    assert chunks == [(0, 16, False), (16, 16, False), (32, 8, True), (40, 1, True)]
    assert sampled == [7, 7]
    assert_all_blocks_free(sched)


def test_running_requests_are_scheduled_before_waiting_ones_fcfs():
    sched = make_scheduler(max_num_batched_tokens=12)
    sched.add_request(make_request("a", 10))
    run_step(sched)  # a prefilled
    sched.add_request(make_request("b", 20))
    sched.add_request(make_request("c", 3))
    out, _ = run_step(sched)
    # a decodes first, then b (FCFS) takes the rest of the budget; c must wait its turn.
    assert out.num_scheduled_tokens == {"a": 1, "b": 11}


def test_preemption_takes_the_last_running_request_and_recomputes_it():
    # 8 usable blocks of 4 tokens. a, b, c each hold 2 blocks after prefill (8 tokens).
    sched = make_scheduler(num_blocks=9, max_num_batched_tokens=64)
    for rid in "abc":
        sched.add_request(make_request(rid, 8, max_tokens=8))
    run_step(sched)
    assert sched.kv.num_free_blocks == 2
    # Decoding: a and b need a third block each; 2 free -> fine. Then c needs one: none left.
    out, _ = run_step(sched)
    assert out.preempted_req_ids == ["c"]
    assert [r.request_id for r in sched.running] == ["a", "b"]
    c = sched.waiting[0]
    assert c.request_id == "c" and c.status == RequestStatus.PREEMPTED
    assert c.num_computed_tokens == 0 and c.num_output_tokens == 1
    assert sched.kv.block_ids("c") == []
    # c comes back once blocks free up, recomputing prompt + its generated token.
    while sched.has_unfinished_requests():
        out, outputs = run_step(sched)
        if "c" in out.req_ids and out.start_positions[out.req_ids.index("c")] == 0:
            assert len(out.token_ids[out.req_ids.index("c")]) == 9
    assert_all_blocks_free(sched)


def test_a_request_preempts_itself_when_it_is_the_last_one():
    sched = make_scheduler(num_blocks=4, max_num_batched_tokens=64)  # 3 usable blocks
    sched.add_request(make_request("a", 12, max_tokens=8))
    run_step(sched)
    out = sched.schedule()  # needs a 4th block: nothing else to preempt but itself
    assert out.req_ids == [] and out.preempted_req_ids == ["a"]
    assert sched.waiting[0].request_id == "a"
    sched.finish_requests(["a"])
    assert_all_blocks_free(sched)


def test_no_waiting_request_is_admitted_in_a_step_that_preempted():
    sched = make_scheduler(num_blocks=9)
    for rid in "abc":
        sched.add_request(make_request(rid, 8, max_tokens=8))
    run_step(sched)
    sched.add_request(make_request("d", 1))
    out, _ = run_step(sched)
    assert out.preempted_req_ids and "d" not in out.req_ids


@pytest.mark.parametrize("where", ["waiting", "running", "finished", "unknown"])
def test_abort_is_idempotent_wherever_the_request_is(where):
    sched = make_scheduler()
    sched.add_request(make_request("a", 5, max_tokens=1))
    sched.add_request(make_request("keep", 5, max_tokens=3))
    if where in ("running", "finished"):
        run_step(sched)  # "a" finishes in its first step (max_tokens=1)
    if where == "running":
        sched.add_request(make_request("b", 5, max_tokens=5))
        run_step(sched)
    target = {"waiting": "a", "running": "b", "finished": "a", "unknown": "nope"}[where]
    sched.finish_requests([target])
    sched.finish_requests([target])
    sched.finish_requests(target)
    _, outputs = run_step(sched)
    aborts = [o for o in outputs if o.finish_reason == wire.FinishReason.ABORT]
    expected = 1 if where in ("waiting", "running") else 0
    assert [o.request_id for o in aborts] == [target] * expected
    while sched.has_unfinished_requests():
        run_step(sched)
    assert_all_blocks_free(sched)


def test_decode_tokens_leave_the_scheduler_as_columns_the_rest_whole():
    sched = make_scheduler()
    sched.add_request(make_request("a", 5, max_tokens=3))
    sched.add_request(make_request("b", 5, max_tokens=4))
    steps = []
    for token in (11, 12, 13):
        out = sched.schedule()
        sampled = {r: token for r, s in zip(out.req_ids, out.sample, strict=True) if s}
        steps.append(sched.update_from_output(out, ModelRunnerOutput(sampled)))
    first, middle, last = steps
    # First tokens are whole outputs (they may report cached prompt tokens).
    assert (first.decode_req_ids, [o.request_id for o in first.outputs]) == ([], ["a", "b"])
    assert (middle.decode_req_ids, middle.decode_token_ids, middle.outputs) == (["a", "b"],
                                                                               [12, 12], [])
    # "a" reaches max_tokens: a whole output with its finish; "b" goes on in the columns.
    assert last.decode_req_ids == ["b"] and last.decode_token_ids == [13]
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in last.outputs] == [
        ("a", [13], wire.FinishReason.LENGTH)]
    assert last.finished_requests == ["a"]
    assert {o.request_id: o.new_token_ids for o in per_request(last)} == {"a": [13], "b": [13]}
    assert last.finished_requests == ["a"]
    last.drop({"b", "a"})
    assert (last.decode_req_ids, last.decode_token_ids, last.outputs) == ([], [], [])


def test_finished_requests_free_blocks_and_reach_the_runner_once():
    sched = make_scheduler()
    sched.add_request(make_request("a", 5, max_tokens=2))
    run_step(sched)
    _, outputs = run_step(sched)
    assert outputs[0].finish_reason == wire.FinishReason.LENGTH
    assert_all_blocks_free(sched)
    assert sched.schedule().finished_req_ids == {"a"}
    assert sched.schedule().finished_req_ids == set()


@pytest.mark.parametrize(
    "params, outputs, finish, stop_reason",
    [
        (dict(max_tokens=3), [5, 5, 5], wire.FinishReason.LENGTH, None),
        (dict(max_tokens=9, stop_token_ids=[6]), [5, 6], wire.FinishReason.STOP, 6),
        (dict(max_tokens=9, stop_token_ids=[6], min_tokens=3), [6, 6, 6],
         wire.FinishReason.STOP, 6),
        (dict(max_tokens=9), [5, 2], wire.FinishReason.STOP, None),  # 2 is eos
        (dict(max_tokens=3, ignore_eos=True), [2, 2, 2], wire.FinishReason.LENGTH, None),
    ],
)
def test_stop_conditions(params, outputs, finish, stop_reason):
    sched = make_scheduler()
    sp = wire.SamplingParams(**params)
    sched.add_request(Request("a", [1, 2, 3], sp, sp.max_tokens, eos_token_id=2))
    produced, last = [], None
    for token in outputs:
        _, outs = run_step(sched, token)
        produced += outs[0].new_token_ids
        last = outs[0]
    assert produced == outputs
    assert last.finish_reason == finish and last.stop_reason == stop_reason
    assert not sched.has_unfinished_requests()


def test_context_length_caps_generation():
    sched = make_scheduler(max_model_len=8)
    sched.add_request(make_request("a", 6, max_tokens=100))
    produced = []
    while sched.has_unfinished_requests():
        _, outs = run_step(sched)
        produced += outs
    assert sum(len(o.new_token_ids) for o in produced) == 2
    assert produced[-1].finish_reason == wire.FinishReason.LENGTH


def test_duplicate_request_id_is_rejected():
    sched = make_scheduler()
    sched.add_request(make_request("a", 3))
    with pytest.raises(ValueError, match="already in the engine"):
        sched.add_request(make_request("a", 3))
    sched.finish_requests("a")


# ----- --scheduling-policy (vLLM's fcfs and priority) ------------------------------------------


def make_ranked(rid: str, priority: int, arrival: float, num_tokens: int = 8,
                max_tokens: int = 8) -> Request:
    params = wire.SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return Request(rid, list(range(100, 100 + num_tokens)), params, max_tokens,
                   arrival_time=arrival, priority=priority)


# (rid, priority, arrival time), added in this order
RANKED = [("a", 2, 1.0), ("b", 0, 3.0), ("c", 0, 2.0), ("d", 1, 0.5), ("e", 0, 2.0)]


@pytest.mark.parametrize("policy, admitted", [
    ("fcfs", ["a", "b", "c", "d", "e"]),  # the order they came in
    ("priority", ["c", "e", "b", "d", "a"]),  # (priority, arrival, id): lower first
])
def test_waiting_requests_are_admitted_in_the_policys_order(policy, admitted):
    sched = make_scheduler(max_num_seqs=1, policy=policy)
    for rid, prio, t in RANKED:
        sched.add_request(make_ranked(rid, prio if policy == "priority" else 0, t))
    assert [r.request_id for r in sched.waiting] == admitted
    order = []
    while sched.has_unfinished_requests():
        out, _ = run_step(sched)
        order += [r for r in out.req_ids if r not in order]
    assert order == admitted


@pytest.mark.parametrize("policy, victim, scheduled", [
    ("fcfs", "c", ["a", "b"]),  # the last admitted
    ("priority", "b", ["a", "c"]),  # the largest (priority, arrival), though already scheduled
])
def test_preemption_picks_the_victim_by_policy(policy, victim, scheduled):
    # 8 usable blocks of 4 tokens: a, b, c hold 2 each after prefill; the decode step needs a
    # third block for each and only 2 are free, so one request is preempted.
    sched = make_scheduler(num_blocks=9, policy=policy)
    prios = {"a": 0, "b": 5, "c": 1} if policy == "priority" else dict.fromkeys("abc", 0)
    for t, rid in enumerate("abc"):
        sched.add_request(make_ranked(rid, prios[rid], float(t)))
    run_step(sched)
    out, _ = run_step(sched)
    assert out.preempted_req_ids == [victim]
    assert out.req_ids == scheduled
    assert out.total_num_scheduled_tokens == 2  # the victim's token was given back
    assert [r.request_id for r in sched.running] == scheduled
    assert sched.kv.block_ids(victim) == []
    while sched.has_unfinished_requests():
        run_step(sched)
    assert_all_blocks_free(sched)


def test_a_preempted_request_waits_in_priority_order_not_at_the_front():
    sched = make_scheduler(num_blocks=9, policy="priority")
    for t, (rid, prio) in enumerate([("a", 0), ("b", 5), ("c", 1)]):
        sched.add_request(make_ranked(rid, prio, float(t)))
    run_step(sched)
    sched.add_request(make_ranked("d", 3, 10.0))  # waits: admitted before b, preempted later
    out, _ = run_step(sched)
    assert out.preempted_req_ids == ["b"]
    assert [r.request_id for r in sched.waiting] == ["d", "b"]


def test_a_priority_under_fcfs_is_refused_in_vllms_words():
    sched = make_scheduler()
    with pytest.raises(ValueError, match=r"^Got priority 3 but Priority scheduling is not "
                                         r"enabled\.$"):
        sched.add_request(make_ranked("a", 3, 0.0))
    assert not sched.has_unfinished_requests()


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        make_scheduler(policy="lifo")
