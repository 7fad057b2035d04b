"""The engine's real termination messages, fed into the operator's classifier.

`shoal serve` is run for real and made to fail the two ways that matter to the restart policy:
a bad flag (permanent: fix the spec) and an EngineCore killed by SIGKILL (transient: restart the
group). What it writes at $SHOAL_TERMINATION_LOG is put into a pod status the way the kubelet
does (`state.terminated.message`; with the operator's `FallbackToLogsOnError`, the log's tail
when the file is empty and the exit code is not 0), and `failure_of` must classify it. No
hand-typed messages.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from shoal.operator import labels as L
from shoal.operator.failures import failure_of

pytest.importorskip("torch")


def _pod(message: str, exit_code: int) -> dict:
    return {"metadata": {"name": "llm-g0-r0", "uid": "u1",
                         "labels": {L.LABEL_GROUP: "0", L.LABEL_RANK: "0"}},
            "spec": {"nodeName": "n1"},
            "status": {"phase": "Failed", "containerStatuses": [{
                "name": L.ENGINE_CONTAINER,
                "state": {"terminated": {"exitCode": exit_code, "reason": "Error",
                                         "message": message,
                                         "finishedAt": "2026-11-30T12:00:00Z"}}}]}}


def _serve(model: str, term: Path, *args: str) -> subprocess.Popen:
    term.write_text("")  # the kubelet creates the file empty
    env = {**os.environ, "SHOAL_TERMINATION_LOG": str(term)}
    log = open(term.with_suffix(".log"), "wb")
    return subprocess.Popen([sys.executable, "-m", "shoal.cli", "serve", model, *args],
                            env=env, stdout=log, stderr=subprocess.STDOUT)


def _kubelet_message(term: Path, exit_code: int) -> str:
    """What the kubelet puts in `terminated.message` under FallbackToLogsOnError: the file, or
    when it is empty and the container failed, the last 80 lines (at most 2048 bytes) of its log."""
    text = term.read_text()
    if text or exit_code == 0:
        return text
    lines = term.with_suffix(".log").read_bytes().splitlines()[-80:]
    return b"\n".join(lines)[-2048:].decode(errors="replace")


def test_bad_flag_is_a_permanent_config_error(tiny_model, tmp_path):
    term = tmp_path / "termination-log"
    proc = _serve(tiny_model, term, "--no-such-flag")
    code = proc.wait(120)
    f = failure_of(_pod(_kubelet_message(term, code), code))
    assert (f.cause, f.permanent, f.exit_code) == ("config_error", True, 2)
    assert "--no-such-flag" in f.message


def test_a_missing_model_is_permanent_and_says_so(tmp_path):
    term = tmp_path / "termination-log"
    proc = _serve(str(tmp_path / "no-such-model"), term)
    code = proc.wait(120)
    f = failure_of(_pod(_kubelet_message(term, code), code))
    assert (f.cause, f.permanent, f.exit_code) == ("model_not_found", True, 2)
    assert "no-such-model" in f.message and "is not a directory" in f.message


def test_a_model_the_engine_refuses_is_permanent_and_named(tiny_model, tmp_path):
    """A model feature the engine does not implement is refused at load (in the EngineCore
    process), named, and permanent: a restart would refuse it again."""
    import json
    import shutil

    model = tmp_path / "chunked"
    shutil.copytree(tiny_model, model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "attention_chunk_size": 8}))
    term = tmp_path / "termination-log"
    proc = _serve(str(model), term, "--max-model-len", "256")
    code = proc.wait(240)
    f = failure_of(_pod(_kubelet_message(term, code), code))
    assert (f.cause, f.permanent, f.exit_code) == ("config_error", True, 1), f
    assert "chunked attention" in f.message and "UnsupportedModelError" in f.message


def test_engine_core_killed_is_a_transient_engine_error(tiny_model, tmp_path):
    import psutil

    term = tmp_path / "termination-log"
    port = 18000 + os.getpid() % 1000
    proc = _serve(tiny_model, term, "--port", str(port), "--max-model-len", "256")
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, "shoal serve exited during start-up"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                assert time.monotonic() < deadline, "shoal serve did not become healthy"
                time.sleep(0.5)
        cores = [p for p in psutil.Process(proc.pid).children(recursive=True)
                 if "engine_core_proc" in " ".join(p.cmdline())]
        assert cores, "no EngineCore process"
        for p in cores:
            p.send_signal(signal.SIGKILL)
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert term.read_text(), "the engine wrote no termination message"
    f = failure_of(_pod(_kubelet_message(term, code), code))
    assert (f.cause, f.permanent, f.rank) == ("engine_error", False, 0)
    assert "SIGKILL" in f.message


def test_the_kubelets_own_log_error_is_not_read_as_the_engines():
    """Seen on a real node: a SIGKILLed rank whose log the kubelet could not read. The message
    is the kubelet's ("... no such file or directory"), not a missing model."""
    msg = ("Error on reading termination message from logs: failed to try resolving symlinks in "
           'path "/var/log/pods/ns_tp2-g0-r1_7b87/engine/0.log": lstat /var/log/pods/ns_tp2-g0-r1'
           "_7b87: no such file or directory")
    f = failure_of(_pod(msg, 137))
    assert (f.cause, f.permanent, f.signal) == ("signaled", False, 9)
