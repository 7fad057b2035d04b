"""Engine death read from pod status (pure): which rank is the root cause, and how it is classed."""

from __future__ import annotations

import pytest
from shoal.contract.termination import Cause, encode
from shoal.operator import labels as L
from shoal.operator.failures import failure_of, root_cause


def pod(
    rank: int,
    *,
    terminated: dict | None = None,
    phase: str = "Running",
    deleting: bool = False,
    reason: str | None = None,
) -> dict:
    meta = {"name": f"llm-g0-r{rank}", "uid": f"uid-{rank}",
            "labels": {L.LABEL_GROUP: "0", L.LABEL_RANK: str(rank)}}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-29T10:00:00Z"
    status: dict = {"phase": phase}
    if reason:
        status["reason"] = reason
    if terminated is not None:
        status["containerStatuses"] = [
            {"name": L.ENGINE_CONTAINER, "state": {"terminated": terminated}}
        ]
    return {"metadata": meta, "spec": {"nodeName": "node-a"}, "status": status}


def term(
    code: int, at: str = "2026-11-29T10:00:05Z", message: str = "", reason: str = "Error", **kw
) -> dict:
    return {"exitCode": code, "finishedAt": at, "message": message, "reason": reason, **kw}


@pytest.mark.parametrize(
    "p, cause, permanent",
    [
        (
            pod(0, terminated=term(1, message=encode(Cause.MODEL_NOT_FOUND, "no /m"))),
            "model_not_found",
            True,
        ),
        (
            pod(0, terminated=term(2, message="shoal serve: error: unrecognized arguments: --x")),
            "config_error",
            True,
        ),
        (pod(1, terminated=term(137, reason="OOMKilled")), "oom_killed", False),
        (pod(1, terminated=term(143)), "signaled", False),
        (pod(0, terminated=term(0, reason="Completed")), "unexpected_exit", False),
        (pod(0, phase="Failed", reason="Evicted"), "unexpected_exit", False),
    ],
)
def test_every_unrequested_exit_is_a_classified_failure(p, cause, permanent):
    f = failure_of(p)
    assert f is not None and f.cause == cause and f.permanent is permanent
    assert f.pod == p["metadata"]["name"] and f.node == "node-a"


def test_signal_is_derived_from_the_exit_code():
    f = failure_of(pod(1, terminated=term(137, reason="OOMKilled")))
    assert (f.exit_code, f.signal, f.reason) == (137, 9, "OOMKilled")


@pytest.mark.parametrize(
    "p", [pod(0), pod(0, terminated=term(0), deleting=True), pod(1, phase="Pending")]
)
def test_running_or_operator_stopped_pods_are_not_failures(p):
    assert failure_of(p) is None


def test_the_first_rank_to_die_is_the_root_cause():
    pods = [
        pod(
            0,
            terminated=term(
                1, at="2026-11-29T10:00:09Z", message=encode(Cause.PEER_LOST, "rank 1 gone")
            ),
        ),
        pod(
            1,
            terminated=term(
                1, at="2026-11-29T10:00:02Z", message=encode(Cause.COLLECTIVE_TIMEOUT, "nccl")
            ),
        ),
    ]
    assert (root_cause(pods).rank, root_cause(pods).cause) == (1, "collective_timeout")


def test_at_the_same_second_a_specific_cause_beats_a_consequence():
    pods = [pod(0, terminated=term(1, message=encode(Cause.PEER_LOST, "peer died"))),
            pod(1, terminated=term(1, message=encode(Cause.OUT_OF_MEMORY, "CUDA OOM")))]
    assert root_cause(pods).cause == "out_of_memory"


def test_a_failure_is_keyed_by_pod_and_finish_time():
    a = failure_of(pod(0, terminated=term(1)))
    b = failure_of(pod(0, terminated=term(1, at="2026-11-29T11:00:00Z")))
    assert a.key != b.key and a.key == failure_of(pod(0, terminated=term(1))).key
