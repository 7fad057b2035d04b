"""vLLM as our child: its pipes, and the signals we pass on to it.

vLLM stays in our process group; the signals a container gets (SIGTERM from the kubelet) reach
only PID 1, so each is forwarded to the child, and vLLM's own drain does the rest (its API
server stops its EngineCore and Workers). SIGTERM and SIGINT mean "asked to stop".
"""

from __future__ import annotations

import os
import signal
import subprocess

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)
STOP = (signal.SIGTERM, signal.SIGINT)


class Child:
    """The supervised command, started with both streams piped to us."""

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv
        self.asked_to_stop = False
        self.status: int | None = None  # waitpid format, once reaped
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     bufsize=0)
        self.pid = self.proc.pid

    def streams(self) -> dict[int, tuple[str, int]]:
        """Pipe fd -> (stream name, our fd it passes through to)."""
        return {self.proc.stdout.fileno(): ("stdout", 1),
                self.proc.stderr.fileno(): ("stderr", 2)}

    def forward(self, signum: int, _frame=None) -> None:
        if signum in STOP:
            self.asked_to_stop = True
        if self.status is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def install(self) -> None:
        for sig in FORWARDED:
            signal.signal(sig, self.forward)

    def reaped(self, status: int) -> None:
        """We reaped it (shoal.supervisor.reaper); tell Popen so it never waits itself."""
        self.status = status
        self.proc.returncode = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else \
            os.WEXITSTATUS(status)
