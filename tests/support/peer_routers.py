"""The real peer routers from the package index, as processes in front of given engine URLs:
`vllm-router` (vllm-project/router, Rust; its `kv_aware` policy consumes vLLM-format KV events
over ZMQ, its `cache_aware` one keeps an approximate radix tree of the prompts it routed) and
`sglang-router` (SGLang's model gateway; `cache_aware`: approximate radix tree, no events).

Both live in one cached venv, `${SHOAL_CACHE:-~/.cache/shoal}/venvs/peer-routers-KEY` (KEY: a
hash of PINS), built once under a file lock and marked `.ready` when complete (cached_venv).
The wheels are self-contained Rust extensions whose Python launchers import setproctitle and
(through mini_lb, at import) aiohttp, orjson, uvicorn and fastapi: PINS are the two routers and
that closure as pip resolved it on 2026-12-02, installed with `--no-deps` (nothing unpinned; no
torch: neither wheel asks for it).

The command lines are the routers' own (`vllm-router --help`, `sglang-router launch --help` of
these versions):

    vllm-router --host H --port P --worker-urls U1 U2 --policy kv_aware \
        --kv-event-source U1=tcp://H:EV1 --kv-event-replay-source U1=tcp://H:RP1 ... \
        --kv-event-block-size 16 --kv-event-model MODEL \
        --prometheus-host H --prometheus-port M
    sglang-router launch --host H --port P --worker-urls U1 U2 --policy cache_aware \
        --prometheus-host H --prometheus-port M

For HTTP workers vllm-router 0.1.17 does not tokenize in the router: for each request it asks
every candidate worker `POST /v1/completions/render` (or `/v1/chat/completions/render`), and on
a 404 `POST /tokenize`, then keys the token ids' blocks itself (sha256 per block, a radix tree;
the engines' block hashes only link a block to its parent and name it in BlockRemoved).
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from shoal.devcluster.layout import cache_root
from support import cached_venv
from support.net import free_ports
from support.wait import wait_for

PINS = (
    "vllm-router==0.1.17", "sglang-router==0.3.2",
    "aiohappyeyeballs==2.7.1", "aiohttp==3.14.5", "aiosignal==1.4.0", "annotated-doc==0.0.7",
    "annotated-types==0.8.0", "anyio==4.16.0", "attrs==26.1.0", "certifi==2026.10.19.post1",
    "charset-normalizer==3.5.3", "click==8.5.1", "fastapi==0.165.0", "frozenlist==1.8.0",
    "h11==0.16.0", "idna==3.20", "multidict==7.2.1", "opentelemetry-api==1.45.2",
    "orjson==3.13.0", "propcache==0.5.4", "pydantic==2.14.4", "pydantic_core==2.50.5",
    "requests==2.34.2", "setproctitle==1.3.8", "starlette==1.10.0", "typing-inspection==0.4.5",
    "typing_extensions==4.16.0", "urllib3==2.8.0", "uvicorn==0.54.0", "yarl==1.25.1",
)
INSTALL_TIMEOUT = 900  # two wheels of 24 MB and 31 MB on a busy 2-core machine
# vLLM's default block size, and Shoal's (engine/config.py): vllm-router must be told it.
BLOCK_SIZE = 16


def env_dir() -> Path:
    key = hashlib.sha256("\n".join(PINS).encode()).hexdigest()[:10]
    return cache_root() / "venvs" / f"peer-routers-{key}"


def _build(root: Path) -> None:
    import shutil

    shutil.rmtree(root, ignore_errors=True)
    cached_venv.run([sys.executable, "-m", "venv", root], 300)
    cached_venv.run([cached_venv.python(root), "-m", "pip", "install", "--quiet", "--no-deps",
                     "--disable-pip-version-check", *PINS], INSTALL_TIMEOUT)
    cached_venv.run([cached_venv.python(root), "-m", "pip", "check"], 120)
    (root / ".ready").write_text("\n".join(PINS) + "\n")


def ensure_peer_routers() -> Path:
    """The venv's bin/ folder (vllm-router, sglang-router), built on first use."""
    return cached_venv.ensure(env_dir(), _build).parent


@dataclass(frozen=True)
class KvSource:
    """One engine group's KV event endpoints (its --kv-events-config endpoint and replay)."""
    events: str
    replay: str | None = None


def vllm_router_args(port: int, metrics_port: int, workers: list[str], policy: str,
                     kv: dict[str, KvSource] | None = None, model: str | None = None,
                     host: str = "127.0.0.1", log_level: str = "info",
                     extra: tuple[str, ...] = ()) -> list[str]:
    """vllm-router's arguments; `kv_aware` needs every worker's KvSource and the model name
    (vllm-router: "HTTP worker model and block-size metadata must be configured statically")."""
    args = ["--host", host, "--port", str(port), "--worker-urls", *workers, "--policy", policy,
            "--prometheus-host", host, "--prometheus-port", str(metrics_port),
            "--log-level", log_level]
    if policy == "kv_aware":
        missing = [w for w in workers if w not in (kv or {})]
        if missing or not model:
            raise ValueError(f"vllm-router kv_aware needs each worker's KV event source "
                             f"(missing: {missing}) and the model name (got {model!r})")
        for w in workers:
            args += ["--kv-event-source", f"{w}={kv[w].events}"]
            if kv[w].replay:
                args += ["--kv-event-replay-source", f"{w}={kv[w].replay}"]
        args += ["--kv-event-block-size", str(BLOCK_SIZE), "--kv-event-model", model]
    return [*args, *extra]


def sglang_router_args(port: int, metrics_port: int, workers: list[str], policy: str,
                       host: str = "127.0.0.1", log_level: str = "info",
                       extra: tuple[str, ...] = ()) -> list[str]:
    return ["launch", "--host", host, "--port", str(port), "--worker-urls", *workers,
            "--policy", policy, "--prometheus-host", host, "--prometheus-port",
            str(metrics_port), "--log-level", log_level, *extra]


@dataclass
class PeerRouter:
    """A peer router process on free ports; its log in a file shown when it fails."""
    name: str  # "vllm-router" or "sglang-router"
    args: list[str]
    log_path: Path
    port: int
    metrics_port: int
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def command(self) -> list[str]:
        return [self.name, *self.args]

    def start(self) -> PeerRouter:
        exe = ensure_peer_routers() / self.name
        log = open(self.log_path, "w")
        # setproctitle renames the process (vllm::router): it is found by pid, never by name.
        self.proc = subprocess.Popen([str(exe), *self.args], stdout=log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "NO_COLOR": "1"},  # some honour it
                                     start_new_session=True)
        log.close()
        return self

    def log(self) -> str:
        """Its output so far, without the terminal colours it writes even to a file."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return re.sub(r"\x1b\[[0-9;]*m", "", text)

    def wait_serving(self, timeout: float = 60.0) -> PeerRouter:
        """Until /readiness answers 200 (both routers: every worker passed its health check)."""
        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited with {self.proc.returncode} during "
                                     f"start-up:\n{self.log()[-4000:]}")
            try:
                return httpx.get(f"{self.url}/readiness", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, timeout, interval=0.2, what=f"{self.name} to serve",
                 detail=lambda: self.log()[-2000:])
        return self

    def metrics(self) -> dict[str, float]:
        """Every sample of its Prometheus exporter as {'name{labels}': value}."""
        out = {}
        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                out[key] = float(value)
        return out

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM, then SIGKILL of its process group after `timeout`; the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


def vllm_router(tmp: Path, workers: list[str], policy: str, **kw) -> PeerRouter:
    """A vllm-router (not started) on free ports in front of `workers`."""
    port, metrics_port = free_ports(2)
    return PeerRouter("vllm-router", vllm_router_args(port, metrics_port, workers, policy, **kw),
                      tmp / f"vllm-router-{policy}-{port}.log", port, metrics_port)


def sglang_router(tmp: Path, workers: list[str], policy: str = "cache_aware",
                  **kw) -> PeerRouter:
    """An sglang-router (not started) on free ports in front of `workers`."""
    port, metrics_port = free_ports(2)
    return PeerRouter("sglang-router",
                      sglang_router_args(port, metrics_port, workers, policy, **kw),
                      tmp / f"sglang-router-{policy}-{port}.log", port, metrics_port)
