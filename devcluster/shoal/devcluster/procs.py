"""How the dev cluster runs things: short commands, long steps with a heartbeat, and long-running
components that die with their starter; plus its progress lines and its one error type.
"""

from __future__ import annotations

import ctypes
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

T0 = time.monotonic()


class DevClusterError(RuntimeError):
    """A step failed; the message says which and quotes what it printed."""


def log(msg: str) -> None:
    """One progress line on stderr, with the seconds since this process started."""
    print(f"[cluster +{time.monotonic() - T0:5.0f}s] {msg}", file=sys.stderr, flush=True)


def run(argv: list[str], *, check: bool = True, input: bytes | None = None,
        timeout: float | None = None, env: dict | None = None, cwd: Path | None = None
        ) -> subprocess.CompletedProcess:
    res = subprocess.run(argv, input=input, capture_output=True, timeout=timeout, env=env,
                         cwd=cwd)
    if check and res.returncode != 0:
        out = (res.stderr or b"").decode(errors="replace").strip()[-2000:]
        raise DevClusterError(
            f"{' '.join(map(str, argv[:6]))} failed (exit {res.returncode}): {out}")
    return res


def run_logged(argv: list[str], log_path: Path, *, what: str, env: dict | None = None,
               cwd: Path | None = None, heartbeat: float = 30.0) -> None:
    """Run a long step with its output in `log_path`; a progress line every `heartbeat` seconds
    (the log's last line), the log's tail in the error if it fails."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, env=env, cwd=cwd)
        next_beat = t0 + heartbeat
        while proc.poll() is None:
            time.sleep(0.5)
            if time.monotonic() >= next_beat:
                next_beat += heartbeat
                log(f"{what}: {time.monotonic() - t0:.0f}s ... {last_line(log_path)}")
    if proc.returncode != 0:
        raise DevClusterError(f"{what} failed (exit {proc.returncode}); log {log_path}:\n"
                              f"{tail(log_path, 30)}")
    log(f"{what}: done in {time.monotonic() - t0:.0f}s")


def tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def last_line(path: Path) -> str:
    return tail(path, 1).strip()[:140]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """preexec_fn: SIGTERM the child when the starting process dies (no strays after a crash)."""
    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def cmdline(pid: int) -> list[str] | None:
    """The argv of a live process (not a zombie), or None."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    if stat.split(") ")[-1][:1] == "Z":
        return None
    return raw.decode(errors="replace").split("\0")[:-1]


def pid_runs(pid: int, needle: str) -> bool:
    """True if `pid` is alive and its command line mentions `needle` (guards against reused
    pids)."""
    argv = cmdline(pid)
    return argv is not None and needle in " ".join(argv)


def wait_until(cond: Callable[[], object], what: str, timeout: float,
               check: Callable[[], None] = lambda: None, interval: float = 0.5):
    """Poll `cond` until it returns something true (returned); `check` raises when a component
    it depends on died, so a dead process fails the wait at once, not at its deadline."""
    deadline = time.monotonic() + timeout
    while True:
        check()
        val = cond()
        if val:
            return val
        if time.monotonic() > deadline:
            raise DevClusterError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


class Process:
    """A long-running component and its log, started in a session of its own."""

    def __init__(self, name: str, argv: list[str], log: Path) -> None:
        self.name, self.argv, self.log = name, argv, log
        self.proc: subprocess.Popen | None = None

    def start(self, cwd: Path | None = None, tie_to_parent: bool = True) -> Process:
        """`tie_to_parent`: SIGTERM it when this Python process dies (PR_SET_PDEATHSIG)."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                cwd=cwd, start_new_session=True,
                preexec_fn=die_with_parent if tie_to_parent else None)
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def exited(self) -> str | None:
        """Why it is no longer running (its exit code and log tail), or None while it runs."""
        if self.proc is None or self.proc.poll() is None:
            return None
        return (f"{self.name} exited with code {self.proc.returncode}; log {self.log}:\n"
                f"{tail(self.log)}")

    def check(self) -> None:
        why = self.exited()
        if why:
            raise DevClusterError(why)

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM, SIGKILL after `grace` seconds; reaps it."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
