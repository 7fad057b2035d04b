"""The termination-message format shared by the engine (writer) and the operator (reader)."""

import json

import pytest
from shoal.contract.termination import (
    MAX_MESSAGE_BYTES,
    TEXT_RULES,
    Cause,
    classify_text,
    encode,
    is_permanent,
    parse_termination_message,
    write_termination_message,
)


def test_a_written_message_reads_back_with_every_field(tmp_path):
    path = tmp_path / "termination-log"
    assert write_termination_message(
        Cause.OUT_OF_MEMORY, "CUDA OOM in step", rank=3, exit_code=1, path=str(path)
    )
    msg = parse_termination_message(path.read_text())
    assert (msg.cause, msg.rank, msg.exit_code, msg.message) == (
        Cause.OUT_OF_MEMORY,
        3,
        1,
        "CUDA OOM in step",
    )
    assert msg.structured and msg.pid and msg.time.endswith("Z")
    assert not msg.permanent


def test_a_huge_message_is_cut_to_the_kubernetes_limit_keeping_head_and_tail():
    message = "FIRST LINE\n" + "x\"\n" * 5000 + "LAST LINE"
    text = encode(Cause.ENGINE_ERROR, message, rank=0, exit_code=1)
    assert len(text.encode()) <= MAX_MESSAGE_BYTES
    decoded = json.loads(text)["message"]
    assert decoded.startswith("FIRST LINE") and decoded.endswith("LAST LINE")


def test_multibyte_text_never_exceeds_the_limit():
    text = encode(Cause.ENGINE_ERROR, "é€😀" * 3000)
    assert len(text.encode()) <= MAX_MESSAGE_BYTES
    json.loads(text)


@pytest.mark.parametrize(
    "text, cause",
    [
        (None, Cause.UNKNOWN),
        ("", Cause.UNKNOWN),
        (
            "Traceback (most recent call last):\n torch.OutOfMemoryError: CUDA out of memory",
            Cause.OUT_OF_MEMORY,
        ),
        (
            "RuntimeError: [Rank 1] Watchdog caught collective operation timeout: WorkNCCL",
            Cause.COLLECTIVE_TIMEOUT,
        ),
        (
            "OSError: /models/missing is not a local folder and is not a valid model identifier",
            Cause.MODEL_NOT_FOUND,
        ),
        # Generic phrases are not permanent faults (a missing NCCL segment, a bad batch).
        (
            "FileNotFoundError: [Errno 2] No such file or directory: '/dev/shm/nccl-1'",
            Cause.UNKNOWN,
        ),
        (
            "Traceback (most recent call last):\nValueError: top_k must be positive",
            Cause.ENGINE_ERROR,
        ),
        ("vllm serve: error: unrecognized arguments: --bogus", Cause.CONFIG_ERROR),
        (
            "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue",
            Cause.ENGINE_ERROR,
        ),
        ("{not json", Cause.UNKNOWN),
        ('{"foreign": "json"}', Cause.UNKNOWN),
        ('{"cause": "from_the_future", "message": "m"}', Cause.UNKNOWN),
    ],
)
def test_text_that_is_not_ours_is_accepted_and_classified(text, cause):
    msg = parse_termination_message(text)
    assert msg.cause == cause


def test_only_configuration_errors_are_permanent():
    assert is_permanent(Cause.CONFIG_ERROR) and is_permanent("model_not_found")
    assert not any(
        is_permanent(c)
        for c in (Cause.ENGINE_ERROR, Cause.COLLECTIVE_TIMEOUT, Cause.OOM_KILLED, "nonsense")
    )


def test_writing_outside_a_pod_is_a_silent_no_op(monkeypatch):
    monkeypatch.delenv("SHOAL_TERMINATION_LOG", raising=False)
    # /dev/termination-log does not exist outside a pod; the failure path must not raise.
    assert write_termination_message(Cause.ENGINE_ERROR, "x", path="/nonexistent-dir/log") is False


@pytest.mark.parametrize("rule", TEXT_RULES, ids=lambda r: r.cause.value)
def test_each_text_rule_matches_its_fault_and_not_its_look_alikes(rule):
    """The false-positive table: every rule for foreign text has texts it must match and texts
    it must not, so a permanent cause is never read into a transient fault's words."""
    assert rule.matches and rule.must_not_match
    for text in rule.matches:
        assert rule.pattern.search(text), f"{rule.cause.value} must match: {text!r}"
        assert classify_text(text) == rule.cause, text
    for text in rule.must_not_match:
        assert not rule.pattern.search(text), f"{rule.cause.value} must not match: {text!r}"


def test_permanent_text_rules_are_only_the_specific_ones():
    permanent = [r for r in TEXT_RULES if is_permanent(r.cause)]
    assert {r.cause for r in permanent} == {Cause.CONFIG_ERROR, Cause.MODEL_NOT_FOUND}
    for phrase in ("No such file or directory", "does not exist", "ValueError: x must be"):
        assert not any(r.pattern.search(phrase) for r in permanent), phrase


def test_a_supervisor_names_the_process_that_died_and_its_pid(tmp_path):
    # The supervisor in front of a stock vLLM writes for another process: `process` and `pid`
    # are that process's, not the writer's.
    path = tmp_path / "termination-log"
    assert write_termination_message(Cause.SIGNALED, "EngineCore (pid 40) killed by SIGKILL (9)",
                                     rank=1, exit_code=1, path=str(path),
                                     process="EngineCore", pid=40)
    msg = parse_termination_message(path.read_text())
    assert (msg.cause, msg.process, msg.pid, msg.rank, msg.exit_code) == (
        Cause.SIGNALED, "EngineCore", 40, 1, 1)
    assert list(json.loads(path.read_text()))[-1] == "process"  # appended: last on the wire
