"""Real `shoal serve` processes for tests and benchmarks: ServerProcess (any `shoal` server
subprocess on a free port, its log in a file shown when it fails), ServeProcess (`shoal serve`
with an engine on the test model) and `healthy_server` (a module's server, healthy, stopped on
exit). Shared by the serving, router and packaging tests and the benchmarks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil
from support.net import free_port
from support.wait import wait_for

API_KEY = "test-key"
MODEL_NAME = "tiny"
# Small KV budget: sizing 1 GiB of blocks costs seconds on a 2-core machine.
KV_BYTES = "64M"


class ServerProcess:
    """A `shoal serve ...` subprocess on a free port; logs go to a file shown when it fails.

    Shared by the serving tests (engine servers) and the router tests (`shoal router`)."""

    def __init__(self, args: list[str], log_path: Path, env: dict, api_key: str | None) -> None:
        self.api_key = api_key
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def wait_answering(self, path: str, what: str, timeout: float):
        """Poll GET `path` until it answers 200; fail at once (with the log) if the process
        exits."""
        def answering():
            if self.proc.poll() is not None:
                raise AssertionError(f"{what}: process exited with {self.proc.returncode}:\n"
                                     f"{self.log()[-4000:]}")
            try:
                return httpx.get(f"{self.url}{path}", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(answering, timeout, interval=0.2, what=what, detail=lambda: self.log()[-2000:])
        return self

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then SIGKILL of the whole process group after `timeout`; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


class ServeProcess(ServerProcess):
    """`shoal serve` with an engine, on the test model."""

    def __init__(self, model: str, tmp: Path, *flags: str, env: dict | None = None,
                 api_key: str | None = None) -> None:
        self.port = free_port()
        self.termination_log = tmp / f"termination-{self.port}.log"
        args = [sys.executable, "-m", "shoal.cli", "serve", model, "--host", "127.0.0.1",
                "--port", str(self.port), "--served-model-name", MODEL_NAME,
                "--kv-cache-memory-bytes", KV_BYTES, *flags]
        if api_key:
            args += ["--api-key", api_key]
        full_env = {**os.environ, "SHOAL_TERMINATION_LOG": str(self.termination_log),
                    **(env or {})}
        super().__init__(args, tmp / f"serve-{self.port}.log", full_env, api_key)

    def wait_healthy(self, timeout: float = 180.0) -> ServeProcess:
        return self.wait_answering("/health", "shoal serve to become healthy", timeout)

    def engine_pid(self) -> int:
        kids = psutil.Process(self.proc.pid).children()
        engines = [k for k in kids if "engine_core_proc" in " ".join(k.cmdline())]
        assert len(engines) == 1, [k.cmdline() for k in kids]
        return engines[0].pid

    def metric(self, name: str, labels: str = "") -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        for line in text.splitlines():
            if line.startswith(name + "{") and labels in line:
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"metric {name} {labels} not found")

    def wait_exit(self, timeout: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"shoal serve did not exit in {timeout} s:\n"
                                 f"{self.log()[-3000:]}") from None


@contextmanager
def healthy_server(model: str, tmp_path_factory, *flags: str,
                   api_key: str | None = None) -> Iterator[ServeProcess]:
    """A module's `shoal serve` with these flags, healthy, stopped on exit (module fixtures)."""
    s = ServeProcess(model, tmp_path_factory.mktemp("serve"), *flags, api_key=api_key)
    try:
        yield s.wait_healthy()
    finally:
        s.stop()
