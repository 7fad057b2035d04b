"""The autoscaler's decision, as a pure function:

    decide(spec.autoscaling, replicas, ready, samples, memory, wake, now) -> Decision

No API call, no clock read: the groups that are Ready, what each one's rank 0 reported
(autoscale_metrics.Sample, None for a group that did not answer), what earlier decisions left
in status.autoscaling, the wake Lease's renewTime and the time go in; the group count and why come
out. Table-tested in tests/operator/test_op_autoscale.py. The rule (docs/operator.md,
"Autoscaling"):

- value: requestsPerGroup = running + waiting over the ready groups / their number;
  kvCacheUsage = the mean KV usage; ttftP90Seconds = the p90 of the first tokens of all ready
  groups since the previous scrape. need = ceil(ready * value / target) (HPA's proportional
  rule), kept at the current count within TOLERANCE, at least 1 while any request runs or
  waits, clamped to [minReplicas, maxReplicas]. Only zero requests give 0.
- scale up only after need stayed above the current count for scaleUpStabilizationSeconds
  (to the lowest need seen in that time); scale down only after it stayed below for
  scaleDownDelaySeconds (to the highest need seen): so scale to zero needs that long with no
  request at all. A direction change also waits that long after the last scale.
- hold: while a ready group does not answer its /metrics (not counted as idle), while no
  group is Ready, and below the current count while a desired group is not Ready yet.
- at zero: a wake (the renewTime of the Lease `NAME-wake`, renewed by a router holding a
  request) newer than the last scale starts max(minReplicas, 1) groups at once.
- spec.replicas is the count the autoscaler starts from (clamped); afterwards it is ignored
  (a `kubectl scale` does not change the count; the Autoscaling condition says so).
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from shoal.operator.autoscale_metrics import Sample, merge, quantile
from shoal.operator.observed import iso, parse_time
from shoal.operator.spec import AutoscaleMetric, AutoscalingSpec

TOLERANCE = 0.1  # |ratio - 1| within this: no change (HPA's default)
PERIOD_SECONDS = 15.0  # how often a pass scrapes and decides while autoscaling is on
WAKE_POLL_SECONDS = 2.0  # at zero: how often a pass reads the wake Lease
WAKE_LEASE = "the wake Lease's renewTime"
UP, DOWN = "Up", "Down"

# What status.autoscaling keeps between passes (besides what it reports).
WINDOW_KEYS = ("upSince", "upTo", "downSince", "downTo")


@dataclass(frozen=True)
class Decision:
    desired: int  # the group count from now on
    current: int  # the count before this decision
    reason: str
    metric: str
    value: float | None  # the aggregate the rule used; None when none was measured
    target: float
    values: Mapping[int, float] = field(default_factory=dict)  # per ready group
    direction: str | None = None  # UP or DOWN when this decision scales
    memory: dict = field(default_factory=dict)  # status.autoscaling after this pass

    @property
    def event(self) -> tuple[str, str] | None:
        """(reason, message) of the ScaledUp / ScaledDown Event this decision posts."""
        if self.direction is None:
            return None
        return f"Scaled{self.direction}", f"{self.current} -> {self.desired} groups: {self.reason}"


def parse_wake(text: str | None) -> dt.datetime | None:
    """An RFC 3339 time (`2026-12-02T08:00:00Z`, fractions and offsets allowed); None if not."""
    if not text:
        return None
    try:
        t = dt.datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        return None
    return t if t.tzinfo else None


def _fmt(x: float | None) -> str:
    return "none" if x is None else f"{x:.3g}"


def _clamp(n: int, a: AutoscalingSpec) -> int:
    return max(a.min_replicas, min(a.max_replicas, n))


def _measure(a: AutoscalingSpec, samples: Mapping[int, Sample]) -> tuple[float | None, dict]:
    """The aggregate value of the target metric and each group's own."""
    if a.metric is AutoscaleMetric.REQUESTS_PER_GROUP:
        values = {g: s.requests for g, s in samples.items()}
        return sum(values.values()) / len(values), values
    if a.metric is AutoscaleMetric.KV_CACHE_USAGE:
        values = {g: s.kv_usage for g, s in samples.items()}
        return sum(values.values()) / len(values), values
    values = {g: q for g, s in samples.items() if (q := quantile(0.9, s.ttft)) is not None}
    return quantile(0.9, merge(s.ttft for s in samples.values())), values


def _need(a: AutoscalingSpec, current: int, ready: int, value: float | None,
          requests: float) -> int:
    if requests <= 0:
        return _clamp(0, a)
    if value is None:  # TTFT with no first token since the last scrape: nothing to go by
        return _clamp(current, a)
    raw = ready * value / a.target
    if math.isinf(raw):  # a target so small the count overflows (the schema takes any > 0;
        return a.max_replicas  # found by fuzzing: 5e-324 raised OverflowError in every pass)
    if current and abs(raw / current - 1) <= TOLERANCE:
        return _clamp(current, a)
    return _clamp(max(1, math.ceil(round(raw, 6))), a)


def decide(a: AutoscalingSpec, *, replicas: int, ready: set[int] | frozenset[int],
           samples: Mapping[int, Sample | None] | None, memory: Mapping | None,
           wake: str | None, now: dt.datetime) -> Decision:
    """The group count from now on. `ready`: indices of Ready groups; `samples`: this pass's
    scrape (None: no scrape this pass, the count holds)."""
    mem = dict(memory or {})
    d = _Decider(a, mem, now)
    if "desiredGroups" not in mem:
        start = _clamp(replicas, a)
        return d.hold(start, 0, f"autoscaling on: starting at {start} groups (spec.replicas "
                                f"{replicas} within [{a.min_replicas}, {a.max_replicas}])")
    current = int(mem["desiredGroups"])
    live = sorted(g for g in ready if g < current)
    if current < a.min_replicas:
        return d.scale(UP, current, a.min_replicas, len(live), f"below minReplicas "
                                                               f"{a.min_replicas}")
    if current > a.max_replicas:
        return d.scale(DOWN, current, a.max_replicas, len(live),
                       f"above maxReplicas {a.max_replicas}")
    if current == 0:
        return d.from_zero(wake)
    if samples is None:
        return d.hold(current, len(live), mem.get("reason") or "waiting for the first scrape",
                      keep=True)
    if not live:
        return d.hold(current, 0, f"no group Ready yet of {current}: nothing to measure",
                      clear=True)
    silent = [g for g in live if samples.get(g) is None]
    if silent:
        return d.hold(current, len(live),
                      f"group {', '.join(map(str, silent))} did not answer /metrics: holding at "
                      f"{current} (a group without metrics is not counted as idle)", clear=True)
    answered = {g: samples[g] for g in live}
    value, values = _measure(a, answered)
    if value is not None and not math.isfinite(value):  # NaN or Inf in /metrics: nothing to go
        value = None  # by, and no number JSON (status) can carry
    values = {g: v for g, v in values.items() if math.isfinite(v)}
    requests = sum(s.requests for s in answered.values())
    need = _need(a, current, len(live), value, requests)
    what = (f"{a.metric} {_fmt(value)} (target {a.target:g}) over {len(live)} ready groups, "
            f"{requests:g} requests")
    d.measured(value, values)
    if need < current and len(live) < current:
        return d.hold(current, len(live), f"{what}: no scale-down while {current - len(live)} "
                                          "desired groups are not Ready", clear=True)
    if need > current:
        return d.window(UP, current, need, len(live), what)
    if need < current:
        return d.window(DOWN, current, need, len(live), what)
    return d.hold(current, len(live), f"{what}: {current} groups fit", clear=True)


class _Decider:
    """The steps of one decision over its memory (mutable; never seen outside decide())."""

    def __init__(self, a: AutoscalingSpec, mem: dict, now: dt.datetime):
        self.a, self.mem, self.now = a, mem, now
        self.value: float | None = None
        self.values: dict = {}

    def measured(self, value: float | None, values: dict) -> None:
        self.value, self.values = value, values

    def _out(self, desired: int, current: int, ready: int, reason: str,
             direction: str | None = None, keep: bool = False) -> Decision:
        value = self.mem.get("value") if keep else self.value
        self.mem.update(desiredGroups=desired, currentGroups=ready, metric=str(self.a.metric),
                        target=self.a.target, reason=reason)
        if value is None:
            self.mem.pop("value", None)
        else:
            self.mem["value"] = round(float(value), 4)
        return Decision(desired=desired, current=current, reason=reason,
                        metric=str(self.a.metric), value=value, target=self.a.target,
                        values=dict(self.values), direction=direction, memory=dict(self.mem))

    def hold(self, current: int, ready: int, reason: str, *, clear: bool = False,
             keep: bool = False) -> Decision:
        if clear:
            for k in WINDOW_KEYS:
                self.mem.pop(k, None)
        return self._out(current, current, ready, reason, keep=keep)

    def scale(self, direction: str, current: int, to: int, ready: int, reason: str) -> Decision:
        for k in WINDOW_KEYS:
            self.mem.pop(k, None)
        self.mem.update(lastScaleTime=iso(self.now), lastScaleDirection=direction)
        return self._out(to, current, ready, reason, direction)

    def window(self, direction: str, current: int, need: int, ready: int,
               what: str) -> Decision:
        """need stayed past the current count for the direction's window: scale, to the most
        cautious need seen in it (the lowest going up, the highest going down)."""
        up = direction == UP
        mine, other = (("upSince", "upTo"), ("downSince", "downTo")) if up else (
            ("downSince", "downTo"), ("upSince", "upTo"))
        for k in other:
            self.mem.pop(k, None)
        since = parse_time(self.mem.get(mine[0])) or self.now
        seen = self.mem.get(mine[1])
        to = need if seen is None else (min if up else max)(int(seen), need)
        if (to <= current) if up else (to >= current):
            # What the window saw does not move the count (a window left from before the last
            # scale, or a need that came back): it starts again from this need.
            since, to = self.now, need
        self.mem.update({mine[0]: iso(since), mine[1]: to})
        wait = (self.a.scale_up_stabilization_seconds if up
                else self.a.scale_down_delay_seconds)
        name = "scaleUpStabilizationSeconds" if up else "scaleDownDelaySeconds"
        if (self.now - since).total_seconds() < wait:
            return self._out(current, current, ready,
                             f"{what}: {to} groups wanted since {iso(since)}; {name} is {wait}s")
        last = parse_time(self.mem.get("lastScaleTime"))
        turned = self.mem.get("lastScaleDirection") not in (None, direction)
        if turned and last and (self.now - last).total_seconds() < wait:
            return self._out(current, current, ready,
                             f"{what}: {to} groups wanted; no direction change within {name} "
                             f"({wait}s) of the last scale ({self.mem['lastScaleDirection']} at "
                             f"{iso(last)})")
        return self.scale(direction, current, to, ready, f"{what}; wanted since {iso(since)}")

    def from_zero(self, wake: str | None) -> Decision:
        start = max(self.a.min_replicas, 1)
        at = parse_wake(wake)
        last = parse_time(self.mem.get("lastScaleTime"))
        if wake and at is None:
            return self.hold(0, 0, f"{WAKE_LEASE} {wake!r} is not an RFC 3339 time: ignored",
                             clear=True)
        if at is not None and (last is None or at > last):
            return self.scale(UP, 0, start, 0, f"wake requested at {wake} ({WAKE_LEASE})")
        return self.hold(0, 0, "scaled to zero: no request for scaleDownDelaySeconds; a held "
                               f"request (it renews {WAKE_LEASE}) starts {start} "
                               f"group{'s' if start > 1 else ''}", clear=True)


def verdict(replicas: int, decision: Decision, hpas) -> tuple[bool, str, str]:
    """The Autoscaling condition: who decides the count, and an HPA that would fight over it
    (`hpas`: autoscale_hpa.HPAs, None when not listed)."""
    msg = f"the autoscaler decides: {decision.desired} groups ({decision.reason})"
    names = tuple(getattr(hpas, "names", ()) or ())
    error = getattr(hpas, "error", "") or ""
    if names:
        return False, "HPAConflict", (
            f"HorizontalPodAutoscaler {', '.join(names)} targets this InferenceEngine while "
            "spec.autoscaling is set: the operator ignores spec.replicas, so that HPA has no "
            f"effect; delete it or remove spec.autoscaling. {msg}")[:2000]
    if replicas != decision.desired:
        reason = "SpecReplicasIgnored"
        msg += (f"; spec.replicas ({replicas}) is ignored while spec.autoscaling is set "
                "(kubectl scale has no effect)")
    else:
        reason = "Active"
    if error:
        msg += f"; {error}"
    return True, reason, msg[:2000]
