"""Reaping: as PID 1 (or a child subreaper) every orphan of vLLM becomes ours to wait for.

A Worker whose EngineCore was killed is re-parented here; its exit status, seen only by
whoever reaps it, is real information, so every reaped status is returned, not dropped.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

from shoal.supervisor import tracer

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def set_subreaper() -> bool:
    """Make orphaned descendants come to us even when we are not PID 1. False where the
    platform has no prctl (then orphans go to the namespace's init, as without us)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def reap() -> list[tuple[int, int]]:
    """Every child or tracee (shoal.supervisor.tracer) that has ended, as (pid, waitpid
    status); a tracee's ptrace-stop is resumed at once. Never blocks."""
    reaped = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return reaped
        if pid == 0:
            return reaped
        if os.WIFSTOPPED(status):
            tracer.resume(pid, status)
            continue
        reaped.append((pid, status))
