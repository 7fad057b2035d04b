"""The stand-in hub as a real process on a free port, and `shoal fetch` as a real subprocess."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from shoal.contract.termination import TerminationMessage, parse_termination_message
from support.models import ensure_model
from support.net import free_port
from support.wait import wait_for

HUB_SCRIPT = Path(__file__).resolve().parents[1] / "support" / "stand_in_hub.py"
REPO_ID = "shoal/tiny"


class Hub:
    """`python stand_in_hub.py --root ROOT --port PORT ...`, answering before it is returned."""

    def __init__(self, root: Path, log: Path, *flags: str, port: int | None = None,
                 cdn: bool = True) -> None:
        self.root, self.log_path = root, log
        self.port = port or free_port()
        args = [sys.executable, str(HUB_SCRIPT), "--root", str(root), "--host", "127.0.0.1",
                "--port", str(self.port), *flags]
        if cdn:  # LFS files through a 302 to another origin, as the hub's CDN
            args += ["--cdn-url", f"http://localhost:{self.port}"]
        self._log = open(log, "a")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT)
        wait_for(self._answers, 20, interval=0.1, what="the stand-in hub to answer",
                 detail=lambda: log.read_text()[-2000:])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _answers(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"stand-in hub exited: {self.log_path.read_text()[-2000:]}")
        try:
            return httpx.get(f"{self.url}/_stats", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stats(self) -> dict:
        return httpx.get(f"{self.url}/_stats", timeout=5).json()

    def downloads(self) -> dict[str, int]:
        return self.stats()["downloads"]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self._log.close()


@dataclass
class Fetched:
    rc: int
    out: str
    err: str
    termination: TerminationMessage | None


def fetch_env(hub_url: str, tmp: Path, token: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HF_HUB_CACHE")}
    env.update(HF_ENDPOINT=hub_url, HF_HOME=str(tmp / "hf-home"),
               SHOAL_TERMINATION_LOG=str(tmp / f"termination-{os.urandom(4).hex()}"))
    if token is not None:
        env["HF_TOKEN"] = token
    return env


def fetch_cmd(uri: str, cache: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "shoal.cli", "fetch", uri, "--cache-dir", str(cache), *extra]


def finished(proc: subprocess.Popen, env: dict, timeout: float = 120) -> Fetched:
    out, err = proc.communicate(timeout=timeout)
    path = Path(env["SHOAL_TERMINATION_LOG"])
    msg = parse_termination_message(path.read_text()) if path.exists() else None
    return Fetched(proc.returncode, out, err, msg)


def start_fetch(uri: str, cache: Path, env: dict, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(fetch_cmd(uri, cache, *extra), env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def run_fetch(uri: str, cache: Path, hub_url: str, tmp: Path, token: str | None = None,
              timeout: float = 120, extra: tuple[str, ...] = ()) -> Fetched:
    env = fetch_env(hub_url, tmp, token)
    return finished(start_fetch(uri, cache, env, *extra), env, timeout)


@pytest.fixture(scope="session")
def hub_root(tmp_path_factory) -> Path:
    """ROOT/shoal/tiny: the project's tiny model, as a hub repository."""
    root = tmp_path_factory.mktemp("hub-root")
    (root / "shoal").mkdir()
    (root / "shoal" / "tiny").symlink_to(ensure_model("shoal-tiny", "tiny"))
    return root


@pytest.fixture
def hub(hub_root, tmp_path):
    h = Hub(hub_root, tmp_path / "hub.log")
    yield h
    h.kill()
