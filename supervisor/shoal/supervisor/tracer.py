"""Seeing a vLLM process's exit status for certain: PTRACE_SEIZE on its leader thread.

A pidfd and the zombie's /proc/PID/stat lose the race to the parent most of the time (vLLM's
API server reaps its killed EngineCore within microseconds). A ptrace tracer is told first:
"a zombie ptracee is only visible to its ptracer" (kernel/exit.c), and the real parent gets it
once the tracer has waited for it. PTRACE_SEIZE stops nothing by itself; the cost is that a
signal delivered to the traced thread stops it until the tracer resumes it with that signal
(resume(), called from the reaper as soon as waitpid reports the stop). Where ptrace is refused
(a seccomp profile, Yama's ptrace_scope 2 or 3, another tracer) seize() says so and the pidfd
race is all there is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

PTRACE_CONT = 7
PTRACE_SEIZE = 0x4206
PTRACE_LISTEN = 0x4208
PTRACE_EVENT_STOP = 128

_libc = None


def _ptrace(request: int, pid: int, data: int = 0) -> bool:
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return _libc.ptrace(ctypes.c_long(request), ctypes.c_long(pid), ctypes.c_void_p(0),
                            ctypes.c_void_p(data)) == 0
    except (OSError, AttributeError):
        return False


def seize(pid: int) -> bool:
    """Trace `pid`'s leader thread without stopping it; False where the kernel refuses."""
    return _ptrace(PTRACE_SEIZE, pid)


def resume(pid: int, status: int) -> None:
    """A ptrace-stop waitpid reported: deliver the signal it stopped on (as if untraced), or
    leave a group-stop (SIGSTOP) stopped as it would be without us."""
    if status >> 16 == PTRACE_EVENT_STOP:
        _ptrace(PTRACE_LISTEN, pid)
    else:
        _ptrace(PTRACE_CONT, pid, os.WSTOPSIG(status))
