"""An InferenceAdapter's status, as a pure function of what the engine's pass saw: its problem
(nothing to load yet, and why), the engine's serving groups and the sync's view
(adapter_sync.View); and the Events a change of that status is worth."""

from __future__ import annotations

import datetime as dt

from shoal.operator.adapter_spec import Adapter
from shoal.operator.adapter_sync import View
from shoal.operator.events import NORMAL, WARNING
from shoal.operator.phases import AdapterCondition, AdapterPhase
from shoal.operator.status import condition


def _iso(at: float) -> str:
    return dt.datetime.fromtimestamp(at, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def adapter_status(adapter: Adapter, *, problem: str, path: str, serving: list[int],
                   view: View, now: str) -> dict:
    """problem: why nothing is loaded ("" when the adapter is followed); serving: the engine's
    groups whose ranks are all Ready (the N of k/N)."""
    old = adapter.status
    previous = old.get("conditions") or []
    n = len(serving)
    on = sorted(g for g in serving if view.has(g, adapter.name))
    answers = sorted(((g, view.answers[(adapter.name, g)]) for g in serving
                      if (adapter.name, g) in view.answers), key=lambda ga: ga[1].at)
    probe = view.probes.get(adapter.name)
    out = {"loaded": f"{len(on)}/{n}", "loadedGroups": on,
           "observedGeneration": adapter.generation}
    if path:
        out["path"] = path
    if old.get("lastError"):
        out["lastError"] = old["lastError"]
    if answers:
        g, a = answers[-1]
        out["lastError"] = {"group": g, "reason": a.reason, "message": a.message,
                            "permanent": a.permanent, "time": _iso(a.at)}

    def conds(loaded: tuple[bool, str, str], ready: tuple[bool, str, str]) -> list[dict]:
        return [condition(AdapterCondition.LOADED.value, *loaded, adapter.generation, now,
                          previous),
                condition(AdapterCondition.READY.value, *ready, adapter.generation, now,
                          previous)]

    if problem or not n:
        why = problem or f"no group of InferenceEngine {adapter.engine!r} is Ready yet"
        reason = "Waiting" if problem else "NoGroupReady"
        out.update(phase=AdapterPhase.PENDING.value,
                   conditions=conds((False, reason, why), (False, reason, why)))
        return out
    bad = [(g, a) for g, a in answers if a.permanent]
    if bad:
        g, a = bad[-1]
        why = f"group {g} refused the adapter for good: {a.message}"
        loaded = (False, a.reason, why)
    elif len(on) == n:
        loaded = (True, "LoadedOnEveryGroup", f"loaded on every serving group ({n}/{n})")
    else:
        waiting = "; ".join(f"group {g}: {a.message}" for g, a in answers)
        loaded = (False, "Loading", f"loaded on {len(on)}/{n} groups"
                  + (f"; {waiting}" if waiting else ""))
    if probe is not None and probe.ok and probe.groups & set(on):
        # a group that served the probe still has it (a group that died or lost it since is
        # not counted: found by benchmarks/lora_churn.py)
        ready = (True, "ServedThroughService", probe.message)
    elif probe is not None:
        ready = (False, "ProbeFailed", probe.message)
    else:
        ready = (False, "NotLoaded" if not on else "NotProbed",
                 "not loaded on any serving group" if not on else
                 "not probed since the groups that have it changed")
    phase = (AdapterPhase.FAILED if bad and not on else
             AdapterPhase.READY if ready[0] and len(on) == n else AdapterPhase.LOADING)
    out.update(phase=phase.value, conditions=conds(loaded, ready))
    return out


def adapter_events(old: dict, new: dict) -> list[tuple[str, str, str]]:
    """(type, reason, message) for each fact the change from `old` to `new` adds: a group
    that loaded it, a new load failure, becoming Ready."""
    out = []
    for g in sorted(set(new.get("loadedGroups") or []) - set(old.get("loadedGroups") or [])):
        out.append((NORMAL, "Loaded", f"loaded on group {g} from {new.get('path')}"))
    err, before = new.get("lastError"), old.get("lastError")
    if err and err != before:
        out.append((WARNING, "LoadFailed", f"group {err['group']}: {err['message']}"))
    if new.get("phase") != old.get("phase") and new.get("phase") in (
            AdapterPhase.READY.value, AdapterPhase.FAILED.value):
        why = next((c["message"] for c in new.get("conditions") or []
                    if c["type"] == (AdapterCondition.READY.value
                                     if new["phase"] == AdapterPhase.READY.value
                                     else AdapterCondition.LOADED.value)), "")
        out.append((NORMAL if new["phase"] == AdapterPhase.READY.value else WARNING,
                    new["phase"], why))
    return out
