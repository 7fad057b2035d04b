"""autoscale.decide() as a table: each case is a sentence, the spec, and a run of scrapes (time,
load) with the group count each must leave; the memory one decision leaves is the next one's,
as status.autoscaling carries it between passes. Groups are Ready at once unless a step says
which are."""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass, field

import pytest
from shoal.operator.autoscale import UP, decide, parse_wake, verdict
from shoal.operator.autoscale_hpa import HPAs, aimed_at
from shoal.operator.autoscale_metrics import Sample
from shoal.operator.spec import AutoscalingSpec

T0 = dt.datetime(2026, 12, 2, 8, 0, 0, tzinfo=dt.timezone.utc)


def at(s: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=s)


def iso(t: dt.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def spec(target: float = 8, *, metric: str = "requestsPerGroup", lo: int = 1, hi: int = 4,
         up: int = 30, down: int = 60) -> AutoscalingSpec:
    return AutoscalingSpec.of({"autoscaling": {
        "minReplicas": lo, "maxReplicas": hi, metric: target,
        "scaleUpStabilizationSeconds": up, "scaleDownDelaySeconds": down}})


# TTFT buckets as vLLM's histogram has them (cumulative), for first tokens since the last scrape
BOUNDS = (0.1, 0.5, 1.0, 2.5, 5.0, float("inf"))


def ttft(*latencies: float) -> tuple:
    return tuple((b, float(sum(1 for x in latencies if x <= b))) for b in BOUNDS)


@dataclass
class Step:
    t: float
    load: object  # total requests split over the ready groups; a dict group -> Sample | None;
    #               None: no scrape in this pass
    want: int
    ready: set | None = None  # default: every group below the current count
    wake: str | None = None
    direction: str | None = None  # UP / DOWN where this step must scale


@dataclass
class Case:
    name: str
    spec: AutoscalingSpec
    steps: list[Step]
    start: int = 1  # the count the memory starts at
    replicas: int = 1  # spec.replicas (ignored once the memory has a count)
    memory: dict = field(default_factory=dict)
    reason: str = ""  # a piece of the last decision's reason


def even(total: float, groups) -> dict:
    groups = sorted(groups)
    return {g: Sample(running=total / len(groups), waiting=0, kv_usage=0) for g in groups}


CASES = [
    Case("steady load at the target: the count never moves",
         spec(), start=2,
         steps=[Step(t, 16, 2) for t in range(0, 600, 15)], reason="2 groups fit"),
    Case("within the 10% tolerance: no change",
         spec(), start=2, steps=[Step(0, 17, 2), Step(40, 17, 2), Step(80, 15, 2)]),
    Case("a ramp: more groups once the need stayed up for scaleUpStabilizationSeconds, to the "
         "lowest need seen in that window",
         spec(),
         steps=[Step(0, 8, 1), Step(15, 12, 1), Step(30, 20, 1), Step(45, 30, 2, direction=UP),
                Step(60, 40, 2), Step(75, 40, 2), Step(90, 40, 4, direction=UP),
                Step(105, 40, 4)]),
    Case("a spike shorter than scaleUpStabilizationSeconds adds no group",
         spec(), steps=[Step(0, 8, 1), Step(15, 80, 1), Step(30, 8, 1), Step(45, 8, 1),
                        Step(60, 8, 1)]),
    Case("scaleUpStabilizationSeconds 0: one scrape over the target scales at once, clamped to "
         "maxReplicas", spec(up=0), steps=[Step(0, 100, 4, direction=UP)]),
    Case("flapping input (need 3, then 1, alternating) leaves the count where it is",
         spec(), start=2,
         steps=[Step(t, 24 if i % 2 == 0 else 4, 2) for i, t in enumerate(range(0, 300, 15))]),
    Case("down after scaleDownDelaySeconds below, to the highest need seen in it",
         spec(), start=4,
         steps=[Step(0, 8, 4), Step(30, 16, 4), Step(59, 8, 4), Step(60, 8, 2, direction="Down"),
                Step(75, 8, 2)]),
    Case("after a scale-up, a sudden drop waits the full scale-down delay: one direction "
         "change per window", spec(up=0), start=1,
         steps=[Step(0, 24, 3, direction=UP), Step(15, 0, 3), Step(30, 0, 3), Step(74, 0, 3),
                Step(75, 0, 1, direction="Down")]),
    Case("a group that stops answering its metrics holds the count (it is not idle), and the "
         "delay starts again once it answers",
         spec(), start=2,
         steps=[Step(0, {0: Sample(0, 0, 0), 1: Sample(0, 0, 0)}, 2),
                Step(45, {0: Sample(0, 0, 0), 1: None}, 2),
                Step(75, {0: Sample(0, 0, 0), 1: None}, 2),
                Step(90, {0: Sample(0, 0, 0), 1: Sample(0, 0, 0)}, 2),
                Step(149, {0: Sample(0, 0, 0), 1: Sample(0, 0, 0)}, 2),
                Step(150, {0: Sample(0, 0, 0), 1: Sample(0, 0, 0)}, 1, direction="Down")]),
    Case("a pass without a scrape decides nothing", spec(up=0), start=1,
         steps=[Step(0, None, 1), Step(15, None, 1)]),
    Case("a group not Ready yet blocks a scale-down (it may be starting) but not a scale-up",
         spec(up=0), start=3,
         steps=[Step(0, 1, 3, ready={0}), Step(100, 1, 3, ready={0, 1}),
                Step(115, 40, 4, ready={0, 1}, direction=UP)],
         reason="40 requests; wanted since"),
    Case("no group Ready yet: nothing to measure, the count holds", spec(up=0), start=2,
         steps=[Step(0, {}, 2, ready=set())], reason="no group Ready yet"),
    Case("a manual `kubectl scale` (spec.replicas 5) while autoscaling: the autoscaler's count "
         "stays", spec(), start=2, replicas=5, steps=[Step(0, 16, 2), Step(100, 16, 2)]),
    Case("first decision: spec.replicas is the starting count, clamped to [min, max]",
         spec(hi=2), start=None, replicas=3, steps=[Step(0, None, 2)], reason="starting at 2"),
    Case("below minReplicas (the spec's bound was raised): up to it at once",
         spec(lo=3), start=1, steps=[Step(0, 0, 3, direction=UP)]),
    Case("above maxReplicas: down to it at once", spec(hi=2), start=4,
         steps=[Step(0, 100, 2, direction="Down")]),
    Case("minReplicas 0: scale to zero only after scaleDownDelaySeconds with no request at all",
         spec(lo=0), start=2,
         steps=[Step(0, 0, 2), Step(30, 1, 2), Step(45, 0, 2), Step(60, 0, 1, direction="Down"),
                Step(75, 0, 1), Step(134, 0, 1), Step(135, 0, 0, direction="Down"),
                Step(150, {}, 0, ready=set())],
         reason="scaled to zero"),
    Case("a window left from before the last scale (found on pods: a status that kept it) "
         "starts again: 1 -> 0 after the full delay, never a '1 -> 1' scale",
         spec(lo=0), start=1,
         memory={"downSince": iso(at(-100)), "downTo": 1, "lastScaleTime": iso(at(-50)),
                 "lastScaleDirection": "Down"},
         steps=[Step(0, 0, 1), Step(59, 0, 1), Step(60, 0, 0, direction="Down")]),
    Case("minReplicas 0 with a little load keeps one group", spec(lo=0), start=2,
         steps=[Step(0, 1, 2), Step(60, 1, 1, direction="Down"), Step(200, 1, 1)]),
    Case("at zero a wake request older than the scale-down is spent; a newer one starts a group",
         spec(lo=0), start=0,
         memory={"lastScaleTime": iso(at(-100)), "lastScaleDirection": "Down"},
         steps=[Step(0, {}, 0, ready=set()),
                Step(15, {}, 0, ready=set(), wake=iso(at(-200))),
                Step(30, {}, 1, ready=set(), wake="2026-12-02T08:00:29.5Z", direction=UP),
                Step(31, None, 1, ready=set())]),
    Case("a wake time that is no time is ignored, named", spec(lo=0), start=0,
         steps=[Step(0, {}, 0, ready=set(), wake="soon")], reason="not an RFC 3339 time"),
    Case("kvCacheUsage: the mean usage of the ready groups against the target",
         spec(0.6, metric="kvCacheUsage", up=0), start=2,
         steps=[Step(0, {0: Sample(4, 0, 0.9), 1: Sample(4, 0, 0.9)}, 3, direction=UP)]),
    Case("kvCacheUsage near zero with requests running keeps a group (only no request is idle)",
         spec(0.6, metric="kvCacheUsage", lo=0, down=0), start=1,
         steps=[Step(0, {0: Sample(1, 0, 0.0)}, 1)]),
    Case("ttftP90Seconds: the p90 of all groups' first tokens since the last scrape",
         spec(1.0, metric="ttftP90Seconds", up=0), start=2,
         steps=[Step(0, {0: Sample(5, 0, 0, ttft(0.2, 0.3, 2.0, 2.2)),
                         1: Sample(5, 0, 0, ttft(0.2, 0.4, 2.1, 2.4))}, 4, direction=UP)]),
    Case("a target so small that the proportional count overflows (the schema takes any > 0; "
         "fuzzing found 5e-324 raising in every pass): the most groups",
         spec(5e-324, up=0), start=1, steps=[Step(0, 3, 4, direction=UP)]),
    Case("a metric that is no number (NaN in /metrics): the count holds, and no NaN goes to "
         "status (JSON has none)", spec(0.6, metric="kvCacheUsage", up=0, down=0), start=2,
         steps=[Step(0, {0: Sample(1, 0, float("nan")), 1: Sample(1, 0, 0.5)}, 2)]),
    Case("ttftP90Seconds with no first token in the interval but requests waiting: hold",
         spec(1.0, metric="ttftP90Seconds", up=0, down=0), start=2,
         steps=[Step(0, {0: Sample(0, 3, 0), 1: Sample(0, 3, 0)}, 2)]),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_decide(case: Case):
    memory = dict(case.memory)
    if case.start is not None:
        memory["desiredGroups"] = case.start
    got, reason = [], ""
    for s in case.steps:
        current = int(memory.get("desiredGroups", case.replicas))
        ready = set(range(current)) if s.ready is None else s.ready
        samples = (None if s.load is None
                   else s.load if isinstance(s.load, dict) else even(s.load, ready))
        d = decide(case.spec, replicas=case.replicas, ready=ready, samples=samples,
                   memory=memory, wake=s.wake, now=at(s.t))
        got.append((s.t, d.desired, d.direction))
        memory, reason = d.memory, d.reason
        json.dumps(d.memory, allow_nan=False)  # what status carries is JSON
        assert d.memory["desiredGroups"] == d.desired
        assert d.direction is None or d.desired != d.current, "a scale that changes nothing"
    assert got == [(s.t, s.want, s.direction) for s in case.steps]
    assert case.reason in reason


def test_a_scale_names_its_numbers_in_the_event_and_status():
    d = decide(spec(up=0), replicas=1, ready={0}, samples={0: Sample(20, 4, 0.5)},
               memory={"desiredGroups": 1}, wake=None, now=T0)
    assert d.event == ("ScaledUp", "1 -> 3 groups: requestsPerGroup 24 (target 8) over 1 ready "
                                   "groups, 24 requests; wanted since 2026-12-02T08:00:00Z")
    assert d.memory == {"desiredGroups": 3, "currentGroups": 1, "metric": "requestsPerGroup",
                        "target": 8.0, "value": 24.0, "reason": d.reason,
                        "lastScaleTime": "2026-12-02T08:00:00Z", "lastScaleDirection": "Up"}
    assert d.values == {0: 24}


def test_the_condition_says_what_wins():
    d = decide(spec(), replicas=5, ready={0, 1}, samples=even(16, {0, 1}),
               memory={"desiredGroups": 2}, wake=None, now=T0)
    ok, reason, message = verdict(5, d, HPAs())
    assert (ok, reason) == (True, "SpecReplicasIgnored")
    assert "spec.replicas (5) is ignored" in message and "the autoscaler decides: 2" in message
    ok, reason, message = verdict(5, d, HPAs(names=("llm-hpa",)))
    assert (ok, reason) == (False, "HPAConflict") and "llm-hpa" in message
    ok, reason, message = verdict(2, d, HPAs(error="could not list HorizontalPodAutoscalers: 403"))
    assert (ok, reason) == (True, "Active") and "403" in message


def test_hpas_aimed_at_the_engine_are_found_by_their_target():
    def hpa(name, kind="InferenceEngine", target="llm", api="shoal.dev/v1alpha1"):
        return {"metadata": {"name": name},
                "spec": {"scaleTargetRef": {"apiVersion": api, "kind": kind, "name": target}}}
    items = [hpa("a"), hpa("b", kind="Deployment"), hpa("c", target="other"),
             hpa("d", api="other.io/v1"), hpa("e", api="")]
    assert aimed_at(items, "llm") == ("a", "e")


@pytest.mark.parametrize("text, want", [
    ("2026-12-02T08:00:00Z", T0), ("2026-12-02T09:00:00+01:00", T0),
    ("2026-12-02T08:00:00.250Z", T0 + dt.timedelta(milliseconds=250)),
    ("2026-12-02T08:00:00", None), ("soon", None), ("", None), (None, None)])
def test_the_wake_time_is_rfc3339(text, want):
    assert parse_wake(text) == want

