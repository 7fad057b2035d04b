"""The supervisor with real processes: a Python child standing in for `vllm serve`, and its
grandchildren titled as vLLM titles its processes (`VLLM::EngineCore`)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from shoal.contract.termination import Cause, parse_termination_message

pytestmark = pytest.mark.process

TIMEOUT = 60


def script(tmp_path, name: str, code: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(code))
    return str(path)


def read_line(stream) -> str:
    line = stream.readline()
    assert line, "the child ended before saying it was ready"
    return line.decode().strip()


def interpreter(version: str) -> str:
    """The python3.X a vLLM image may have (the bundle supports 3.9 to 3.12); this test machine
    has them through pyenv. Absent: skipped, saying which."""
    if version == "this":
        return sys.executable
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    for found in [shutil.which(f"python{version}"),
                  *sorted(map(str, pyenv.glob(f"{version}.*/bin/python{version}")))]:
        if found and subprocess.run([found, "-c", ""], capture_output=True).returncode == 0:
            return found  # (a pyenv shim without a selected version fails: the next one)
    pytest.skip(f"no working python{version} here")


@pytest.mark.parametrize("version", ["this", "3.9", "3.10", "3.11", "3.12"])
def test_a_killed_grandchild_is_named_with_its_signal(tmp_path, bundle, version, start):
    # The grandchild's parent reaps it 2 s late: the zombie's exit status is there to read.
    child = script(tmp_path, "child.py", """
        import os, signal, subprocess, sys, time
        core = subprocess.Popen(["bash", "-c", "exec -a VLLM::EngineCore sleep 60"])
        print(core.pid, flush=True)
        time.sleep(1.5)  # the supervisor scans /proc every 0.5 s
        os.kill(core.pid, signal.SIGKILL)
        time.sleep(2)
        core.wait()
        sys.exit(0)  # as vllm serve does when its EngineCore was killed
    """)
    log = tmp_path / "termination-log"
    sup = start(bundle, log, sys.executable, child, python=interpreter(version))
    core_pid = int(read_line(sup.stdout))
    out, err = sup.communicate(timeout=TIMEOUT)
    assert sup.returncode == 1, err.decode()
    msg = parse_termination_message(log.read_text())
    assert (msg.cause, msg.process, msg.pid, msg.rank) == (Cause.SIGNALED, "EngineCore",
                                                            core_pid, 0)
    first = msg.message.splitlines()[0]
    assert first == f"EngineCore (pid {core_pid}, rank 0) killed by SIGKILL (9)", msg.message
    assert f"then APIServer (pid {sup_child(msg.message)}, rank 0) exited with code 0" \
        in msg.message


def sup_child(text: str) -> str:
    return text.split("then APIServer (pid ", 1)[1].split(",", 1)[0]


RACE = """
import json, os, signal, subprocess, sys
from shoal.supervisor import supervise
from shoal.supervisor.child import Child
from shoal.supervisor.procwatch import ProcWatch
from shoal.supervisor.vllm_log import LogMemory
r, w = os.pipe(); os.set_blocking(w, False); signal.set_wakeup_fd(w)
signal.signal(signal.SIGCHLD, lambda *_: None)
child = Child([sys.executable, sys.argv[1], sys.argv[2]])
watch = ProcWatch(os.getpid())
supervise.loop(child, watch, LogMemory(), r)
print(json.dumps({"exit": child.status, "rows": [[p.pid, p.status, p.seen_by, p.traced]
                  for p in watch.procs.values() if p.title.startswith("VLLM::")]}))
"""


def test_a_parent_that_reaps_at_once_still_gets_its_status_and_ours_is_never_wrong(tmp_path):
    """A parent blocked in waitpid reaps its killed child within microseconds. Traced, the
    status comes to us first and the parent still gets the true one; untraced (ptrace refused
    here) the zombie's status is often gone first: what we record is right or 'not seen'."""
    n = 20
    child = script(tmp_path, "reaps.py", """
        import os, signal, subprocess, sys, time
        for _ in range(int(sys.argv[1])):
            p = subprocess.Popen(["bash", "-c", "exec -a VLLM::Worker_TP1 sleep 60"])
            time.sleep(0.7)
            os.kill(p.pid, signal.SIGKILL)
            if p.wait() != -signal.SIGKILL:
                sys.exit(f"the parent saw {p.returncode}")
    """)
    out = subprocess.run([sys.executable, "-c", RACE, child, str(n)], capture_output=True,
                         timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    result = json.loads(out.stdout.decode().splitlines()[-1])
    assert result["exit"] == 0  # every parent saw SIGKILL: tracing changed nothing for it
    rows = result["rows"]
    assert len(rows) == n
    traced = [status for _, status, _, was_traced in rows if was_traced]
    assert all(status == signal.SIGKILL for status in traced), rows  # waitpid format: 9
    seen = [status for _, status, by, was_traced in rows if by and not was_traced]
    assert all(status == signal.SIGKILL for status in seen), rows
    assert all(status is None for _, status, by, _ in rows if not by)
    print(f"a prompt reaper: {len(traced)} of {n} traced (all seen), untraced {len(seen)} of "
          f"{n - len(traced)} seen")


def test_a_traced_process_gets_its_signals_and_its_parent_its_exit_code(tmp_path, bundle, start):
    # Tracing stops the traced thread on each signal until we pass it on: it must arrive.
    child = script(tmp_path, "child.py", f"""
        import os, signal, subprocess, sys, time
        code = ("import signal, sys, time\\n"
                "signal.signal(signal.SIGUSR1, lambda *_: print('usr1', flush=True))\\n"
                "signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))\\n"
                "print('up', flush=True)\\n"
                "while True: time.sleep(0.05)\\n")
        core = subprocess.Popen(["bash", "-c", 'exec -a VLLM::EngineCore "$0" -c "$1"',
                                 {sys.executable!r}, code], stdout=subprocess.PIPE)
        assert core.stdout.readline() == b"up\\n"
        time.sleep(1.5)  # found and traced by the supervisor's scan
        os.kill(core.pid, signal.SIGUSR1)
        print(core.stdout.readline().decode().strip(), flush=True)
        os.kill(core.pid, signal.SIGTERM)
        print(core.wait(), core.pid, flush=True)
    """)
    log = tmp_path / "termination-log"
    sup = start(bundle, log, sys.executable, child)
    out, err = sup.communicate(timeout=TIMEOUT)
    lines = out.decode().split()
    assert lines[:2] == ["usr1", "3"], (out, err)
    msg = parse_termination_message(log.read_text())
    assert (msg.process, msg.pid) == ("EngineCore", int(lines[2]))
    assert msg.message.startswith(f"EngineCore (pid {lines[2]}, rank 0) exited with code 3")


def test_sigterm_reaches_the_child_and_its_exit_code_is_ours_with_no_message(tmp_path, bundle,
                                                                             start):
    child = script(tmp_path, "child.py", """
        import signal, sys, time
        def stop(num, _):
            print(f"got {num}", flush=True)
            sys.exit(7)
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGUSR1, lambda num, _: print(f"got {num}", flush=True))
        print("ready", flush=True)
        while True:
            time.sleep(0.1)
    """)
    log = tmp_path / "termination-log"
    sup = start(bundle, log, sys.executable, child)
    assert read_line(sup.stdout) == "ready"
    sup.send_signal(signal.SIGUSR1)
    assert read_line(sup.stdout) == f"got {int(signal.SIGUSR1)}"
    sup.send_signal(signal.SIGTERM)
    out, err = sup.communicate(timeout=TIMEOUT)
    assert out.decode().strip() == f"got {int(signal.SIGTERM)}"
    assert sup.returncode == 7 and err == b""
    assert log.read_text() == ""


@pytest.mark.parametrize("code, exit_code, cause, how", [
    ("sys.exit(0)", 1, Cause.UNEXPECTED_EXIT, "exited with code 0"),
    ("sys.exit(3)", 3, Cause.UNEXPECTED_EXIT, "exited with code 3"),
    ("os.kill(os.getpid(), signal.SIGKILL)", 137, Cause.SIGNALED, "killed by SIGKILL (9)"),
])
def test_an_unasked_end_is_never_exit_0_and_always_says_why(tmp_path, bundle, code, exit_code,
                                                              cause, how, start):
    child = script(tmp_path, "child.py", f"import os, signal, sys\n{code}\n")
    log = tmp_path / "termination-log"
    sup = start(bundle, log, sys.executable, child)
    _, err = sup.communicate(timeout=TIMEOUT)
    assert sup.returncode == exit_code, err.decode()
    msg = parse_termination_message(log.read_text())
    assert (msg.cause, msg.process, msg.pid, msg.exit_code) == (cause, "APIServer", msg.pid,
                                                                exit_code)
    assert msg.message.startswith(f"APIServer (pid {msg.pid}, rank 0) {how}"), msg.message


def test_an_orphan_is_reaped_and_its_exit_status_reported(tmp_path, bundle, start):
    # The child leaves a grandchild behind: it comes to us (PR_SET_CHILD_SUBREAPER) and we reap
    # it, so its exit code is known although its parent is gone. It lives 3 s, several of the
    # supervisor's 0.5 s scans: one that ended before any scan saw its title would be nobody's
    # (seen once in CI with 1 s on the loaded 2-core machine).
    child = script(tmp_path, "child.py", """
        import subprocess
        p = subprocess.Popen(["bash", "-c", "exec -a VLLM::Worker_TP0 bash -c 'sleep 3; exit 5'"])
        print(p.pid, flush=True)
    """)
    log = tmp_path / "termination-log"
    sup = start(bundle, log, sys.executable, child)
    orphan = int(read_line(sup.stdout))
    _, err = sup.communicate(timeout=TIMEOUT)
    assert sup.returncode == 1, err.decode()
    msg = parse_termination_message(log.read_text())
    assert (msg.process, msg.pid) == ("Worker_TP0", orphan), msg.message
    assert msg.message.startswith(f"Worker_TP0 (pid {orphan}, rank 0, TP 0) exited with code 5")
    with pytest.raises(ProcessLookupError):  # reaped, not a zombie left to init
        os.kill(orphan, 0)


def test_both_streams_pass_through_byte_for_byte(tmp_path, bundle, start):
    payload = tmp_path / "payload"
    chunks = {
        "stdout": [b"(APIServer pid=1) INFO x\r\n", os.urandom(70000), b"\xff\xfe not utf-8\n",
                   b"x" * 200000, b"no newline at the end"],
        "stderr": [b"Traceback (most recent call last):\n", b'  File "x"\n',
                   b"ValueError: \xe2\x82\xac\n", os.urandom(5000), b"\r", b"tail"],
    }
    for name, parts in chunks.items():
        (tmp_path / name).write_bytes(b"".join(parts))
    child = script(tmp_path, "child.py", f"""
        import os, signal, sys, time
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        for name, fd in (("stdout", 1), ("stderr", 2)):
            data = open(os.path.join({str(tmp_path)!r}, name), "rb").read()
            for i in range(0, len(data), 4093):  # odd chunks, split anywhere
                os.write(fd, data[i:i + 4093])
        open({str(payload)!r}, "w").close()
        while True:
            time.sleep(0.1)
    """)
    log = tmp_path / "termination-log"
    with open(tmp_path / "out", "wb") as out, open(tmp_path / "err", "wb") as err:
        sup = start(bundle, log, sys.executable, child, stdout=out, stderr=err)
        deadline = time.monotonic() + TIMEOUT
        while not payload.exists():
            assert time.monotonic() < deadline and sup.poll() is None
            time.sleep(0.05)
        time.sleep(0.5)
        sup.send_signal(signal.SIGTERM)
        assert sup.wait(timeout=TIMEOUT) == 0
    assert (tmp_path / "out").read_bytes() == (tmp_path / "stdout").read_bytes()
    assert (tmp_path / "err").read_bytes() == (tmp_path / "stderr").read_bytes()


def test_a_command_that_cannot_start_is_a_config_error(tmp_path, bundle, start):
    log = tmp_path / "termination-log"
    sup = start(bundle, log, "/nonexistent/vllm", "serve")
    _, err = sup.communicate(timeout=TIMEOUT)
    assert sup.returncode == 127
    msg = parse_termination_message(log.read_text())
    assert msg.cause == Cause.CONFIG_ERROR and "/nonexistent/vllm" in msg.message
    assert msg.permanent and b"cannot start '/nonexistent/vllm'" in err
