"""Worker processes: how they are started, how they die with their parent, how an exit is named.

A worker is `python -m shoal.engine.executor.worker_proc SPEC_JSON`, started by the EngineCore
process (node 0) or by a headless node's supervisor. It asks the kernel to SIGKILL it when that
parent dies (PR_SET_PDEATHSIG), so killing any process of the tree leaves no orphaned worker.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import sys
import time

import msgspec
from shoal.engine.worker.cpu.cpus import omp_wait_env

PR_SET_PDEATHSIG = 1


def die_with_parent(expected_parent: int) -> None:
    """SIGKILL this process when its parent dies; exit now if that already happened."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the parent's shutdown still stops us
        return
    if expected_parent and os.getppid() != expected_parent:
        os._exit(1)


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "is still running"
    if returncode < 0:
        sig = signal.Signals(-returncode).name
        hint = " (possibly the kernel's OOM killer)" if sig == "SIGKILL" else ""
        return f"was killed by {sig}{hint}"
    return f"exited with code {returncode}"


def spawn_worker(spec: msgspec.Struct, env: dict[str, str] | None = None) -> subprocess.Popen:
    # Before torch loads OpenMP in the child (worker/cpu/cpus.py: when idle OpenMP threads sleep).
    child_env = {**os.environ, **omp_wait_env()[0], **(env or {})}
    return subprocess.Popen(
        [sys.executable, "-m", "shoal.engine.executor.worker_proc",
         msgspec.json.encode(spec).decode()],
        stdin=subprocess.DEVNULL, env=child_env)


class ExitWatcher:
    """Waits on several processes' exits at once (Linux pidfds; polling elsewhere)."""

    def __init__(self, procs: dict[int, subprocess.Popen]) -> None:
        self.procs = dict(procs)  # key (a rank) -> process
        self.fds: dict[int, int] = {}
        for key, proc in self.procs.items():
            try:
                self.fds[os.pidfd_open(proc.pid)] = key
            except (AttributeError, OSError):
                pass

    def wait(self, timeout: float) -> list[int]:
        """Keys of the processes that have exited (waits up to `timeout` for the first)."""
        if self.fds and len(self.fds) == len(self.procs):
            select.select(list(self.fds), [], [], timeout)
        else:
            time.sleep(timeout)
        return [key for key, proc in self.procs.items() if proc.poll() is not None]

    def forget(self, key: int) -> None:
        self.procs.pop(key, None)
        for fd, k in list(self.fds.items()):
            if k == key:
                os.close(fd)
                del self.fds[fd]

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()


def stop_processes(procs: list[subprocess.Popen], timeout: float) -> None:
    """Wait up to `timeout` for processes that were told to stop, then SIGKILL the rest; reaps
    them all. (Workers ignore SIGTERM: see worker_proc.)"""
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
