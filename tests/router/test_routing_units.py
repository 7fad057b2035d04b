"""The pure parts added for the fleet: prefix affinity (with its load bound and expiry), the
gateway's fleet bookkeeping, the `vllm:*` aggregation and the stream's first-output rule."""

from __future__ import annotations

import json

import pytest
from shoal.router.affinity import PrefixAffinity, make_affinity, prompt_text
from shoal.router.aggregate import aggregate
from shoal.router.discovery import Discovery, Group
from shoal.router.fleet import Fleet
from shoal.router.picker import GroupPicker
from shoal.router.upstream import event_kind

G0, G1, G2 = Group(0, "http://a:8000"), Group(1, "http://b:8000"), Group(2, "http://c:8000")
SYSTEM_A = "You are a helpful assistant for the billing team. " * 10
SYSTEM_B = "You translate English into French, word for word. " * 10


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _picker(imbalance: int = 2, clock: Clock | None = None) -> GroupPicker:
    clock = clock or Clock()
    picker = GroupPicker(clock=clock, affinity=PrefixAffinity(imbalance, clock=clock))
    picker.set_groups([G0, G1, G2])
    return picker


def _keys(picker: GroupPicker, system: str, question: str) -> list[int]:
    return picker.affinity.keys(prompt_text({"messages": [
        {"role": "system", "content": system}, {"role": "user", "content": question}]}))


def test_shared_prefixes_stay_on_one_group_and_different_ones_spread():
    picker = _picker()
    a = {picker.pick(prefix=_keys(picker, SYSTEM_A, f"question {i}")) for i in range(6)}
    b = {picker.pick(prefix=_keys(picker, SYSTEM_B, f"question {i}")) for i in range(6)}
    assert len(a) == 1 and len(b) == 1 and a != b


def test_a_busy_home_spills_over_but_keeps_its_claim():
    picker = _picker(imbalance=2)
    home = picker.pick(prefix=_keys(picker, SYSTEM_A, "q"))
    for _ in range(3):
        picker.acquire(home)
    spill = picker.pick(prefix=_keys(picker, SYSTEM_A, "q2"))
    assert spill != home  # 3 outstanding > least (0) + 2
    for _ in range(3):
        picker.release(home)
    assert picker.pick(prefix=_keys(picker, SYSTEM_A, "q3")) == home


def test_a_dead_home_moves_the_prefix_and_claims_expire():
    clock = Clock()
    picker = _picker(clock=clock)
    home = picker.pick(prefix=_keys(picker, SYSTEM_A, "q"))
    picker.mark_failed(home, "could not connect")
    moved = picker.pick(prefix=_keys(picker, SYSTEM_A, "q"))
    assert moved != home
    clock.now += 5.0  # the cool-down ran out: the prefix stays where it moved
    assert picker.pick(prefix=_keys(picker, SYSTEM_A, "q")) == moved
    clock.now += 601  # the claim expired: nothing to follow, least-outstanding chooses
    assert picker.affinity.choose(_keys(picker, SYSTEM_A, "q"),
                                  list(picker.states.values())) is None


def test_short_prompts_have_no_key_and_table_is_bounded():
    aff = PrefixAffinity(chunk_chars=8, capacity=5)
    assert aff.keys("short") == [] and len(aff.keys("x" * 100)) == 12
    assert aff.keys("abcdefgh12345678")[0] == aff.keys("abcdefghZZZZZZZZ")[0]
    assert aff.keys("abcdefgh12345678")[1] != aff.keys("abcdefghZZZZZZZZ")[1]
    aff.remember(aff.keys("y" * 100), ("", 0), [("", 0)])
    assert len(aff) == 5
    # held(): the keys each group owns, through claims taken over and keys evicted.
    assert aff.held(("", 0)) == 5 and aff.held(("", 1)) == 0
    aff.remember(aff.keys("z" * 24), ("", 1), [("", 1)])  # 3 new keys push 3 of group 0 out
    assert (aff.held(("", 0)), aff.held(("", 1)), len(aff)) == (2, 3, 5)
    aff.remember(aff.keys("z" * 24), ("", 0), [("", 0)])  # group 1 is not live: taken over
    assert (aff.held(("", 0)), aff.held(("", 1))) == (5, 0)


def test_prompt_text_of_completions_and_chat():
    assert prompt_text({"prompt": "hello"}) == "hello"
    assert prompt_text({"prompt": ["first", "second"]}) == "first"
    assert prompt_text({"prompt": [1, 2, 3]}) == "1,2,3,"
    chat = prompt_text({"messages": [{"role": "system", "content": "S"},
                                     {"role": "user", "content": [{"type": "text",
                                                                   "text": "hi"}]}]})
    assert chat.startswith("<|system|>S<|user|>") and "hi" in chat
    assert prompt_text("not a dict") == ""
    with pytest.raises(ValueError, match="least-outstanding, prefix-affinity"):
        make_affinity("random")


def test_fleet_lists_models_with_ready_groups_and_merges_same_names():
    seen = []
    fleet = Fleet(seen.append)
    fleet.update("prod/a", Discovery((G0, G1), "alpha"))
    fleet.update("prod/b", Discovery((), "beta"))  # no ready group yet: not served
    fleet.update("dev/a2", Discovery((G0,), "alpha"))
    assert fleet.models() == {"alpha": ["dev/a2", "prod/a"]}
    assert fleet.groups_of("alpha") == {("prod/a", 0), ("prod/a", 1), ("dev/a2", 0)}
    assert [g.name for g in seen[-1]] == ["engine dev/a2 group 0", "engine prod/a group 0",
                                          "engine prod/a group 1"]
    fleet.update("prod/b", Discovery((G2,), "beta"))
    assert fleet.groups_of("beta") == {("prod/b", 2)} and fleet.groups_of("nope") == set()
    fleet.remove("prod/a", "deleted")
    assert fleet.models() == {"alpha": ["dev/a2"], "beta": ["prod/b"]}
    assert Group(1, "http://b", "prod/a").label == "prod/a/1"


ENGINE_METRICS = """\
# HELP vllm:num_requests_waiting Number of requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="{m}"}} {w}
# HELP vllm:kv_cache_usage_perc KV-cache usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="{m}"}} {u}
# HELP vllm:request_success_total Finished requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{{engine="0",finished_reason="length",model_name="{m}"}} {n}
vllm:request_success_created{{engine="0",finished_reason="length",model_name="{m}"}} 1.7e9
# HELP vllm:time_to_first_token_seconds TTFT.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.1",model_name="{m}"}} {n}
vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf",model_name="{m}"}} {n}
vllm:time_to_first_token_seconds_count{{engine="0",model_name="{m}"}} {n}
vllm:time_to_first_token_seconds_sum{{engine="0",model_name="{m}"}} 0.5
# HELP process_cpu_seconds_total CPU.
# TYPE process_cpu_seconds_total counter
process_cpu_seconds_total 3.0
"""


def test_aggregate_sums_per_model_with_vllms_names_and_labels():
    from prometheus_client.parser import text_string_to_metric_families

    texts = [ENGINE_METRICS.format(m="alpha", w=2, u=0.2, n=3),
             ENGINE_METRICS.format(m="alpha", w=1, u=0.4, n=4),
             ENGINE_METRICS.format(m="beta", w=5, u=0.5, n=1)]
    out = aggregate(texts)
    samples = {(s.name, s.labels.get("model_name"), s.labels.get("le")): s.value
               for f in text_string_to_metric_families(out) for s in f.samples}
    assert samples[("vllm:num_requests_waiting", "alpha", None)] == 3
    assert samples[("vllm:num_requests_waiting", "beta", None)] == 5
    assert samples[("vllm:kv_cache_usage_perc", "alpha", None)] == pytest.approx(0.3)
    assert samples[("vllm:request_success_total", "alpha", None)] == 7
    assert samples[("vllm:time_to_first_token_seconds_bucket", "alpha", "+Inf")] == 7
    assert samples[("vllm:time_to_first_token_seconds_sum", "alpha", None)] == 1.0
    assert not [k for k in samples if not k[0].startswith("vllm:") or "created" in k[0]]
    assert aggregate([]) == ""


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode()


@pytest.mark.parametrize("event, kind", [
    (_sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
     ("preamble", 0)),
    (_sse({"choices": [{"index": 0, "delta": {"content": "Hi"}}]}), ("output", 0)),
    (_sse({"choices": [{"index": 0, "text": "x", "finish_reason": None}]}), ("output", 0)),
    (_sse({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}), ("output", 0)),
    (_sse({"choices": [], "usage": {"prompt_tokens": 1}}), ("output", 0)),
    (_sse({"error": {"message": "EngineCore died", "code": 500}}), ("error", 500)),
    (_sse({"error": {"message": "bad", "code": 400}}), ("error", 400)),
    (b"data: [DONE]", ("output", 0)),
    (b": keep-alive comment", ("preamble", 0)),
])
def test_stream_events_before_the_first_output(event, kind):
    assert event_kind(event) == kind
