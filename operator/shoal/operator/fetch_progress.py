"""Download progress of an hf:// group: while a rank's `model-fetch` init container runs, the
operator reads the tail of its log (`progress_reads`: which pods, reconcile.py reads them) and
shows the last progress line (shoal.contract.model_fetch.parse_progress) in the group's message
and `download` status, with an Event when it moved by EVENT_STEP_PERCENT or EVENT_EVERY_SECONDS
passed (`next_download`). Pure, like plan.py: the reads happen in reconcile.py."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping

from shoal.contract import model_fetch as mf
from shoal.contract.model_fetch import Progress

POLL_SECONDS = 10.0  # how often a fetching group's log is read again (no pod event says so)
EVENT_STEP_PERCENT = 10
EVENT_EVERY_SECONDS = 60
LOG_TAIL_LINES = 20


def _init_state(pod: dict, name: str) -> dict:
    for cs in (pod.get("status") or {}).get("initContainerStatuses") or []:
        if cs.get("name") == name:
            return cs.get("state") or {}
    return {}


def fetching(pod: dict) -> bool:
    """The pod's model-fetch init container is running now."""
    return bool(_init_state(pod, mf.FETCH_CONTAINER).get("running"))


def group_progress(tails: Mapping[int, str]) -> Progress | None:
    """The progress of the lowest rank that printed a line (with a shared cache one rank
    downloads and the others wait on its lock)."""
    for _, tail in sorted(tails.items()):
        if (found := mf.parse_progress(tail)) is not None:
            return found
    return None


def percent(p: Progress) -> int:
    return int(100 * p.done_gib / p.total_gib) if p.total_gib > 0 else 0


def next_download(prev: dict | None, progress: Progress, now: dt.datetime,
                  iso) -> tuple[dict, bool]:
    """The group's `download` status after this progress, and whether an Event is due."""
    prev = prev or {}
    pct = percent(progress)
    last_pct, last_at = prev.get("eventPercent"), prev.get("eventTime")
    due = last_pct is None or abs(pct - int(last_pct)) >= EVENT_STEP_PERCENT
    if not due and last_at:
        when = dt.datetime.strptime(last_at, "%Y-%m-%dT%H:%M:%SZ").replace(
            tzinfo=dt.timezone.utc)
        due = (now - when).total_seconds() >= EVENT_EVERY_SECONDS
    out = {"message": progress.text, "percent": pct,
           "eventPercent": pct if due else last_pct,
           "eventTime": iso(now) if due else last_at}
    return out, due
