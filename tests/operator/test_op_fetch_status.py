"""What a model fetch shows and what it decides (fetch_progress.py, failures.py, plan.py), as
tables: the `model-fetch` init container's progress in the group's status and Events, its
permanent failure failing the group naming the repository, a transient one backing off, and a
missing token Secret as a waiting reason naming it."""

from __future__ import annotations

import datetime as dt

import pytest
from shoal.contract import model_fetch as mf
from shoal.contract.model_fetch import HubRef
from shoal.contract.termination import Cause, encode
from shoal.operator import fetch_progress
from shoal.operator import labels as L
from shoal.operator.failures import failure_of
from shoal.operator.observed import startup_stage, waiting_reason
from shoal.operator.phases import GroupPhase, GroupStage
from shoal.operator.plan import Memory, Observed, plan
from shoal.operator.spec import parse
from support.builders import engine

T0 = dt.datetime(2026, 12, 1, 10, 0, 0, tzinfo=dt.timezone.utc)
GIB = 1024 ** 3
REF = HubRef("org/tiny", "main")
BODY = engine("llm", "ns").ranks(2).set(model="hf://org/tiny", modelAuth={"secretName": "hf"})


def iso(t: dt.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def pod(r: int, init_state: dict, *, phase: str = "Pending") -> dict:
    """A rank whose engine container waits for its init container in `init_state`."""
    labels = {L.LABEL_GROUP: "0", L.LABEL_RANK: str(r),
              L.LABEL_REVISION: parse(BODY.obj())[1].revision}
    return {
        "metadata": {"name": f"llm-g0-r{r}", "uid": f"u{r}", "labels": labels,
                     "creationTimestamp": iso(T0 - dt.timedelta(seconds=30))},
        "spec": {"nodeName": "node-a"},
        "status": {"phase": phase,
                   "initContainerStatuses": [{"name": mf.FETCH_CONTAINER, "state": init_state}],
                   "containerStatuses": [{"name": L.ENGINE_CONTAINER, "state": {
                       "waiting": {"reason": "PodInitializing"}}}]},
    }


RUNNING = {"running": {"startedAt": iso(T0)}}


def ended(cause: Cause, message: str, code: int) -> dict:
    return {"terminated": {"exitCode": code, "reason": "Error", "finishedAt": iso(T0),
                           "message": encode(cause, message, exit_code=code)}}


def _plan(pods: list[dict], logs: dict | None = None, memory: dict | None = None,
          now: dt.datetime = T0):
    ref, spec = parse(BODY.obj())
    observed = Observed(ref=ref, pods={0: {int(p["metadata"]["labels"][L.LABEL_RANK]): p
                                           for p in pods}},
                        fetch_logs={0: logs or {}})
    mem = Memory(groups={0: {"index": 0, "phase": "Starting", "restarts": 0,
                             "revision": spec.revision, **(memory or {})}})
    return plan(spec, observed, mem, now)


def _events(p) -> list[tuple[str, str]]:
    return [(a.reason, a.message) for a in p.actions if type(a).__name__ == "EmitEvent"]


def test_a_running_fetch_is_the_groups_stage_and_its_progress_the_message():
    pods = [pod(0, RUNNING), pod(1, RUNNING)]
    assert startup_stage({0: pods[0], 1: pods[1]}) == GroupStage.FETCHING_MODEL
    tail = "fetch org/tiny@main: cached 0 of 3 files\n" + mf.progress_line(REF, GIB, 4 * GIB)
    p = _plan(pods, logs={0: tail, 1: "waiting for the lock on org/tiny"})
    (g,) = p.groups
    assert g["stage"] == GroupStage.FETCHING_MODEL
    assert g["message"] == "0/2 ranks ready; downloading 1.0 of 4.0 GiB (org/tiny@main)"
    assert g["download"]["percent"] == 25
    assert ("ModelDownloading", "group 0: downloading 1.0 of 4.0 GiB (org/tiny@main)") \
        in _events(p)
    assert p.requeue_after == fetch_progress.POLL_SECONDS, "the log is read again"
    assert not any(r == "RankWaiting" for r, _ in _events(p)), "PodInitializing says nothing"


def test_a_fetch_without_a_progress_line_yet_says_so():
    (g,) = _plan([pod(0, RUNNING), pod(1, RUNNING)]).groups
    assert g["message"] == "0/2 ranks ready; fetching the model" and "download" not in g


@pytest.mark.parametrize("last_pct, last_s, pct, due", [
    (None, None, 0, True),  # the first line
    (20, 0, 25, False),  # 5 points, 10 s later
    (20, 0, 30, True),  # 10 points
    (20, -61, 21, True),  # a minute passed
    (90, -30, 95, False),
])
def test_download_events_every_ten_percent_or_minute(last_pct, last_s, pct, due):
    prev = None if last_pct is None else {"eventPercent": last_pct,
                                          "eventTime": iso(T0 + dt.timedelta(seconds=last_s))}
    progress = mf.Progress("org/tiny@main", pct / 100 * 4, 4.0)
    out, emitted = fetch_progress.next_download(prev, progress, T0, iso)
    assert emitted is due and out["percent"] == pct
    assert out["eventPercent"] == (pct if due else last_pct)


def test_the_event_follows_the_memory_of_the_last_one():
    tail = mf.progress_line(REF, int(1.1 * GIB), 4 * GIB)  # 27%: the last Event said 25%
    memory = {"download": {"eventPercent": 25, "eventTime": iso(T0)}}
    p = _plan([pod(0, RUNNING), pod(1, RUNNING)], logs={0: tail}, memory=memory,
              now=T0 + dt.timedelta(seconds=20))
    assert not any(r == "ModelDownloading" for r, _ in _events(p))
    assert p.groups[0]["download"]["eventPercent"] == 25


@pytest.mark.parametrize("cause, code, phase, permanent", [
    (Cause.MODEL_ACCESS_DENIED, 2, GroupPhase.FAILED, True),
    (Cause.MODEL_NOT_FOUND, 2, GroupPhase.FAILED, True),
    (Cause.DOWNLOAD_FAILED, 1, GroupPhase.BACKING_OFF, False),
])
def test_a_failed_fetch_fails_the_group_by_its_cause(cause, code, phase, permanent):
    message = "hf://org/tiny@main: 401 Unauthorized: a token was given (HF_TOKEN) and refused"
    failed = pod(0, ended(cause, message, code), phase="Failed")
    f = failure_of(failed)
    assert (f.cause, f.permanent, f.reason, f.exit_code) == (cause.value, permanent,
                                                            "model-fetch: Error", code)
    p = _plan([failed, pod(1, RUNNING)])
    (g,) = p.groups
    assert g["phase"] == phase and p.last_failure["cause"] == cause.value
    assert "org/tiny" in p.last_failure["message"]


def test_a_failure_message_without_the_repository_gets_it():
    failed = pod(0, ended(Cause.MODEL_ACCESS_DENIED, "401 Unauthorized", 2), phase="Failed")
    p = _plan([failed, pod(1, RUNNING)])
    assert p.last_failure["message"] == "hf://org/tiny@main: 401 Unauthorized"


def test_a_missing_token_secret_is_a_waiting_reason_naming_it():
    waiting = {"waiting": {"reason": "CreateContainerConfigError",
                           "message": 'secret "hf" not found'}}
    pods = [pod(0, waiting), pod(1, waiting)]
    assert waiting_reason(pods[0]) == ('model-fetch: CreateContainerConfigError: secret "hf" '
                                       'not found (spec.modelAuth.secretName)')
    p = _plan(pods)
    (g,) = p.groups
    assert g["phase"] == GroupPhase.STARTING and 'secret "hf" not found' in g["message"]
    (warn,) = [m for r, m in _events(p) if r == "RankWaiting"]
    assert warn.startswith('group 0: rank 0: model-fetch: CreateContainerConfigError: secret "hf"')
