"""The log memory and the report fed real vLLM 0.32.0 output (tests/supervisor/data/README.md):
what vLLM said first, not the last traceback line, decides the cause."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from shoal.contract.termination import Cause
from shoal.supervisor import report
from shoal.supervisor.procwatch import Proc
from shoal.supervisor.vllm_log import MAX_ERRORS, TAIL_LINES, LogMemory

DATA = Path(__file__).parent / "data"


def analysed(case: str) -> LogMemory:
    """Both streams as the supervisor reads them (stdout first: vLLM's logger writes there and
    the API server's own traceback, on stderr, is its last word), in odd-sized chunks."""
    log = LogMemory()
    for stream, ext in (("stdout", "out"), ("stderr", "err")):
        data = (DATA / f"{case}.{ext}").read_bytes()
        for i in range(0, len(data), 777):
            log.feed(stream, data[i:i + 777])
        log.close(stream)
    return log


def ended_child(case: str) -> tuple[list[str], Proc]:
    info = json.loads((DATA / f"{case}.json").read_text())
    child = Proc(pid=4242, ppid=1, starttime="1", title=" ".join(info["cmd"]), ended=1e9,
                 status=info["exit_code"] << 8, seen_by="waitpid")
    return info["cmd"], child


@pytest.mark.parametrize("case, cause, first_line, says", [
    ("b-max-model-len", Cause.CONFIG_ERROR,
     "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig",
     "User-specified max_model_len (100000) is greater than the derived max_model_len"),
    ("c-no-model", Cause.MODEL_NOT_FOUND,
     "huggingface_hub.errors.HFValidationError: Repo id must be in the form 'repo_name' or "
     "'namespace/repo_name': '/nonexistent/model'. Use `repo_type` argument if needed.",
     "'/nonexistent/model'"),
    ("d-unknown-arch", Cause.CONFIG_ERROR,
     "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig",
     "Model architectures ['NoSuchForCausalLM'] are not supported for now"),
])
def test_a_start_up_fault_is_named_with_vllms_own_words(case, cause, first_line, says):
    log = analysed(case)
    [plog] = log.exceptions()  # the API server's config check, before any EngineCore
    assert plog.first_exception.line == first_line
    argv, child = ended_child(case)
    rep = report.build(argv, child, log, [child])
    assert (rep.cause, rep.process, rep.pid, rep.rank, rep.exit_code) == \
        (cause, "APIServer", 4242, 0, 1)
    assert rep.message.startswith(f"APIServer (pid 4242, rank 0) failed: {first_line}")
    assert "\nthen APIServer (pid 4242, rank 0) exited with code 1" in rep.message
    assert says in rep.message


def test_a_normal_run_has_no_exception_and_was_ready():
    log = analysed("a-normal")
    assert log.exceptions() == [] and log.ready
    names = {name for name, _ in log.procs}
    assert {"APIServer", "EngineCore", "Worker"} <= names
    assert log.name_of(29686) == "EngineCore" and log.pid_of("APIServer") == 29040


def test_the_memory_stays_bounded_whatever_the_log():
    log = LogMemory()
    for i in range(20000):
        log.feed("stdout", f"(Worker_TP{i % 200} pid={i % 200}) ERROR 12-02 04:00:00 [x.py:1] "
                           f"boom {i}\n".encode())
        log.feed("stderr", b"Traceback (most recent call last):\nValueError: " + b"x" * 5000
                 + b"\n")
    log.feed("stdout", b"y" * 10_000_000)  # one line that never ends
    assert len(log.procs) <= 64 and len(log.tail) == TAIL_LINES
    assert all(len(p.errors) <= MAX_ERRORS for p in log.procs.values())
    assert all(len(line) <= 1000 for line in log.tail)
    assert len(log._pending["stdout"]) <= 16384
    assert log.procs[("stderr", None)].first_exception.line.startswith("ValueError: xxx")


@pytest.mark.parametrize("case, says", [
    ("usage-unknown-flag", "vllm: error: unrecognized arguments: --no-such-flag"),
    ("usage-bad-dtype", "vllm serve: error: argument --dtype: invalid choice: 'fp7'"),
])
def test_a_flag_vllm_refuses_is_a_config_error_with_argparses_line(case, says):
    log = LogMemory()
    log.feed("stderr", (DATA / f"{case}.err").read_bytes())
    log.close("stderr")
    assert log.usage_error.startswith(says)
    child = Proc(pid=7, ppid=1, starttime="1", title="vllm serve", ended=1.0, status=2 << 8,
                 seen_by="waitpid")
    rep = report.build(["vllm", "serve", "m", "--node-rank", "3"], child, log, [child])
    assert (rep.cause, rep.process, rep.rank, rep.exit_code) == (Cause.CONFIG_ERROR, "APIServer",
                                                                 3, 2)
    assert rep.message.splitlines() == ["APIServer (pid 7, rank 3) exited with code 2",
                                        log.usage_error]


@pytest.mark.parametrize("argv, rank", [
    (["vllm", "serve", "m"], 0), (["vllm", "serve", "m", "--node-rank", "2"], 2),
    (["vllm", "serve", "m", "--node-rank=1", "--headless"], 1),
])
def test_the_rank_is_vllms_node_rank(argv, rank):
    assert report.node_rank(argv) == rank


def test_an_invalid_env_value_refused_at_config_time_is_a_config_error():
    log = analysed("e2-kv-cache-env")  # VLLM_CPU_KVCACHE_SPACE=0.000001 (vLLM reads an int)
    argv, child = ended_child("e2-kv-cache-env")
    rep = report.build(argv, child, log, [child])
    assert rep.cause == Cause.CONFIG_ERROR
    assert "invalid literal for int() with base 10: '0.000001'" in rep.message


@pytest.mark.parametrize("status, how, cause", [
    (9, "killed by SIGKILL (9)", Cause.SIGNALED),
    (None, "exit status not seen", Cause.UNEXPECTED_EXIT),  # its parent reaped it first
])
def test_a_killed_enginecore_is_named_not_the_api_servers_consequence(status, how, cause):
    # The real log of `kill -9` of VLLM::EngineCore (pid 4000) while serving: the API server
    # logs EngineDeadError and exits 0. The EngineCore's end is seen before that log arrives.
    log = analysed("f-kill-enginecore")
    [api] = log.exceptions()
    assert api.name == "APIServer" and api.first_exception.line.startswith(
        "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.")
    assert log.procs[("APIServer", 3971)].errors[0] == "AsyncLLM output_handler failed."
    core = Proc(pid=4000, ppid=3971, starttime="5", title="VLLM::EngineCore", ended=0.0,
                status=status, seen_by="zombie" if status else "")
    worker = Proc(pid=4039, ppid=4000, starttime="6", title="VLLM::Worker", ended=1e12,
                  status=15, seen_by="waitpid")
    argv, child = ended_child("f-kill-enginecore")
    child = Proc(3971, 1, "1", child.title, ended=1e12, status=0, seen_by="waitpid")
    rep = report.build(argv, child, log, [core, worker, child])
    assert (rep.cause, rep.process, rep.pid, rep.exit_code) == (cause, "EngineCore", 4000, 1)
    lines = rep.message.splitlines()
    assert lines[:3] == [f"EngineCore (pid 4000, rank 0) {how}",
                         "then APIServer (pid 3971, rank 0) exited with code 0",
                         "also ended: Worker (pid 4039) killed by SIGTERM (15)"]
    assert "APIServer pid=3971: vllm.v1.engine.exceptions.EngineDeadError" in rep.message


@pytest.mark.parametrize("case, process, pid, cause, first", [
    # The Worker refuses a KV cache bigger than the node; EngineCore and API server follow.
    ("e3-kv-space-too-big", "Worker", 6113, Cause.CONFIG_ERROR,
     "ValueError: Available memory on node 0 (21.4/23.54 GiB) on kv cache allocation is less "
     "than requested memory for kv (1000.0 GiB)."),
    ("e4-kv-bytes-1", "EngineCore", 6417, Cause.CONFIG_ERROR,
     "ValueError: No available memory for the cache blocks."),
    # No lscpu on PATH: a start-up failure, not a configuration vLLM refused; transient.
    ("g-no-compiler", "EngineCore", 4731, Cause.STARTUP_ERROR,
     "subprocess.CalledProcessError: Command 'lscpu --json --extended=CPU,CORE,NODE --online' "
     "returned non-zero exit status 127."),
])
def test_the_first_process_to_fail_is_named_not_the_api_servers_last_line(case, process, pid,
                                                                           cause, first):
    log = analysed(case)
    argv, child = ended_child(case)
    rep = report.build(argv, child, log, [child])
    assert (rep.cause, rep.process, rep.pid, rep.exit_code) == (cause, process, pid, 1)
    assert rep.message.startswith(f"{process} (pid {pid}, rank 0) failed: {first}"), rep.message
    # The API server's own last word is there, after the root cause.
    assert "RuntimeError: Engine core initialization failed. See root cause above." \
        in rep.message
