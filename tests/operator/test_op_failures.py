"""Engine death read from pod status (pure): which rank is the root cause, and how it is classed."""

from __future__ import annotations

import pytest
from shoal.contract.termination import Cause, encode, write_termination_message
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


# ---- a stock vLLM's death, as Shoal's supervisor reports it --------------------------------
# The supervisor writes its message with write_termination_message (shoal.supervisor.supervise);
# the texts follow its report (`NAME (pid P, rank R) killed by SIGKILL (9)`) and vLLM 0.32's own
# lines (/work/vllm-logs, captured from a real `vllm serve`).
ENGINE_CORE_KILLED = ("EngineCore_DP0 (pid 312, rank 0) killed by SIGKILL (9)\n"
                      "then APIServer (pid 7, rank 0) exited with code 0")
MAX_MODEL_LEN = (
    "APIServer (pid 7, rank 0) exited with code 1: pydantic_core._pydantic_core.ValidationError: "
    "1 validation error for ModelConfig\n  Value error, User-specified max_model_len (100000) is "
    "greater than the derived max_model_len (max_position_embeddings=2048.0 or "
    "model_max_length=None in model's config.json).")
WORKER_OOM = ("Worker_TP1 (pid 420, rank 1, TP 1) exited with code 1: torch.OutOfMemoryError: "
              "CUDA out of memory. Tried to allocate 2.00 GiB")


def supervisor_message(tmp_path, cause: Cause, message: str, *, rank: int, exit_code: int,
                       process: str, pid: int) -> str:
    """What the kubelet copies into `terminated.message`: the file the supervisor wrote."""
    path = tmp_path / "termination-log"
    assert write_termination_message(cause, message, rank=rank, exit_code=exit_code,
                                     path=str(path), process=process, pid=pid)
    return path.read_text()


SUPERVISED = [
    # (cause, message, rank, container exit code, process, pid) -> (cause, permanent)
    ((Cause.SIGNALED, ENGINE_CORE_KILLED, 0, 1, "EngineCore_DP0", 312), ("signaled", False)),
    ((Cause.CONFIG_ERROR, MAX_MODEL_LEN, 0, 1, "APIServer", 7), ("config_error", True)),
    ((Cause.OUT_OF_MEMORY, WORKER_OOM, 1, 1, "Worker_TP1", 420), ("out_of_memory", False)),
    ((Cause.MODEL_NOT_FOUND, "APIServer (pid 7, rank 0) exited with code 1: OSError: /m is not "
      "a local folder and is not a valid model identifier", 0, 1, "APIServer", 7),
     ("model_not_found", True)),
]


@pytest.mark.parametrize("written, want", SUPERVISED, ids=[w[0][4] + "-" + w[1][0]
                                                           for w in SUPERVISED])
def test_the_supervisors_message_is_the_failure_naming_its_process(tmp_path, written, want):
    cause, message, rank, code, process, pid = written
    text = supervisor_message(tmp_path, cause, message, rank=rank, exit_code=code,
                              process=process, pid=pid)
    f = failure_of(pod(rank, terminated=term(code, message=text)))
    assert (f.cause, f.permanent) == want
    assert f.process == process and f.message == message  # the supervisor's text, whole
    status = f.to_status()
    assert status["process"] == process and status["message"] == message
    assert (status["cause"], status["permanent"]) == want
    assert f.who == f"rank {rank} pod llm-g0-r{rank} process {process}"


def test_a_message_without_a_process_files_none():
    """Shoal's own engine (runtime Shoal) writes no `process`: lastFailure has none."""
    f = failure_of(pod(0, terminated=term(1, message=encode(Cause.ENGINE_ERROR, "boom", rank=0))))
    assert f.process == "" and "process" not in f.to_status()
    assert f.who == "rank 0 pod llm-g0-r0"


def test_the_supervisors_process_keeps_the_root_cause_rank(tmp_path):
    """A Worker's OOM on rank 1 came first; rank 0's EngineCore then lost its peer."""
    first = supervisor_message(tmp_path, Cause.OUT_OF_MEMORY, WORKER_OOM, rank=1, exit_code=1,
                               process="Worker_TP1", pid=420)
    then = encode(Cause.PEER_LOST, "EngineCore_DP0 (pid 312, rank 0) exited with code 1",
                  rank=0, exit_code=1, process="EngineCore_DP0", pid=312)
    pods = [pod(0, terminated=term(1, at="2026-11-29T10:00:09Z", message=then)),
            pod(1, terminated=term(1, at="2026-11-29T10:00:02Z", message=first))]
    got = root_cause(pods)
    assert (got.rank, got.process, got.cause) == (1, "Worker_TP1", "out_of_memory")
