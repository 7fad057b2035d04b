"""Wait statuses (waitpid's format, also /proc/PID/stat's exit_code) in words and exit codes."""

from __future__ import annotations

import os
import signal


def signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def describe(status: int | None) -> str:
    """`killed by SIGKILL (9)`, `exited with code 1`; `exit status not seen` when unknown."""
    if status is None:
        return "exit status not seen"
    if os.WIFSIGNALED(status):
        num = os.WTERMSIG(status)
        return f"killed by {signal_name(num)} ({num})"
    if os.WIFEXITED(status):
        return f"exited with code {os.WEXITSTATUS(status)}"
    return f"ended with wait status {status}"


def exit_code(status: int) -> int:
    """The shell's convention: the code itself, or 128+N for signal N."""
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status)
    return 1


def signaled(status: int | None) -> bool:
    return status is not None and os.WIFSIGNALED(status)


def clean(status: int | None) -> bool:
    """Exited with code 0."""
    return status is not None and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
