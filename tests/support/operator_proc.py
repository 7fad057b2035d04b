"""The operator as a child process (`python -m shoal.operator`, as the chart runs it), watching
the namespaces that match a pattern on the test control plane."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from pathlib import Path

from support.net import free_port
from support.wait import wait_for

REPO = Path(__file__).resolve().parents[2]


class OperatorProcess:
    """Started with `start()` (returns once its liveness endpoint answers), stopped with
    `stop()`; its log goes to `log_path` (`tail()` for a failure report), its API call counts
    to `stats_path` when given ($SHOAL_OPERATOR_STATS_FILE)."""

    def __init__(self, control_plane, pattern: str, log_path: Path,
                 stats_path: Path | None = None):
        self.control_plane, self.pattern, self.log_path = control_plane, pattern, log_path
        self.stats_path = stats_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> OperatorProcess:
        port = free_port()
        env = {**self.control_plane.env(), "PYTHONUNBUFFERED": "1"}
        if self.stats_path:
            env["SHOAL_OPERATOR_STATS_FILE"] = str(self.stats_path)
        self._log = open(self.log_path, "a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shoal.operator", "--namespace", self.pattern,
             "--liveness", f"http://127.0.0.1:{port}/healthz", "--log-level", "info"],
            env=env, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO)

        def alive():
            if self.proc.poll() is not None:
                raise AssertionError(f"operator exited {self.proc.returncode}:\n{self.tail()}")
            try:
                url = f"http://127.0.0.1:{port}/healthz"
                return urllib.request.urlopen(url, timeout=1).status == 200
            except OSError:
                return False

        wait_for(alive, timeout=60, interval=0.2, what="the operator's liveness endpoint")
        return self

    def stop(self, kill: bool = False) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill() if kill else self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc:
            self._log.close()

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
