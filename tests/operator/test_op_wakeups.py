"""Planned passes (`Wakeups`): pure, with an injected clock; and the thread that runs them."""

from __future__ import annotations

import threading

from shoal.operator.wakeups import Wakeups


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_pass_is_due_at_its_planned_time_and_not_before():
    clock = Clock()
    w = Wakeups(lambda key: None, clock=clock)
    w._due[("ns", "a")] = clock() + 37  # plan without starting the thread
    clock.t += 36.9
    assert w.pop_due() == []
    clock.t += 0.1
    assert w.pop_due() == [("ns", "a")]
    assert w.pop_due() == [], "a due pass runs once"


def test_the_earliest_plan_for_a_resource_wins():
    clock = Clock()
    w = Wakeups(lambda key: None, clock=clock)
    # The plan alone, its loop not started (the next test runs it): a running loop could pop the
    # due passes before this test's pop_due does (it did once, under load).
    w._thread = threading.current_thread()
    w.schedule(("ns", "a"), 30)
    w.schedule(("ns", "a"), 60)  # later: ignored
    assert round(w.pending()[("ns", "a")]) == 30
    w.schedule(("ns", "a"), 5)  # earlier: replaces
    assert round(w.pending()[("ns", "a")]) == 5
    w.schedule(("ns", "b"), 10)
    clock.t += 10
    assert sorted(w.pop_due()) == [("ns", "a"), ("ns", "b")]


def test_the_thread_runs_due_passes_and_survives_a_failing_one():
    done = threading.Event()
    seen = []

    def run(key):
        seen.append(key)
        if key == "bad":
            raise RuntimeError("a pass failed")
        done.set()

    w = Wakeups(run)
    w.schedule("bad", 0.0)
    w.schedule("good", 0.2)
    assert done.wait(timeout=10), "the planned pass never ran"
    assert seen == ["bad", "good"] and w.pending() == {}


def test_a_stored_deadline_is_never_early():
    """Status holds times to the second: a deadline is rounded up, never down (a 4 s backoff
    from 31.729 s must not fire at 35 s)."""
    import datetime as dt

    from shoal.operator.observed import iso_not_before, parse_time

    t = dt.datetime(2026, 11, 30, 15, 37, 35, 729000, tzinfo=dt.timezone.utc)
    assert iso_not_before(t) == "2026-11-30T15:37:36Z" and parse_time(iso_not_before(t)) >= t
    whole = t.replace(microsecond=0)
    assert iso_not_before(whole) == "2026-11-30T15:37:35Z"
