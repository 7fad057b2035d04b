"""The peer software a vLLM user puts around an engine, from the package index, in separate
virtual environments built once per cache: vLLM's router (`vllm-router`), SGLang's router
(`sglang-router`) and the `guidellm` load tester (PINS); and the clients applications are
written with, LangChain's `ChatOpenAI` and the OpenAI Agents SDK (CLIENT_PINS).

Built the way tests/support/vllm_cli.py builds vLLM's parser environment: in
`${SHOAL_CACHE:-~/.cache/shoal}/peer-tools/peers-KEY` (KEY hashes the pins), under a file lock,
renamed into place only once pip has installed everything, so a half-built one is never used
and the main venv is never touched. guidellm requires torch: it is pinned to the CPU wheel the
project already uses (an unpinned torch would be a multi-GB CUDA build). About a minute from the
local index.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

PINS = ("vllm-router==0.1.17", "sglang-router==0.3.2", "guidellm==0.8.1", "torch==2.13.0+cpu")
CLIENT_PINS = ("langchain-openai==1.7.4", "openai-agents==0.24.0")
INSTALL_TIMEOUT = 1500


def env_dir(pins: tuple[str, ...] = PINS, name: str = "peers") -> Path:
    cache = Path(os.environ.get("SHOAL_CACHE") or Path.home() / ".cache" / "shoal")
    key = hashlib.sha256("\n".join(pins).encode()).hexdigest()[:8]
    return cache / "peer-tools" / f"{name}-{key}"


def _ready(root: Path) -> bool:
    return (root / ".ready").is_file() and (root / "bin" / "python").exists()


def _build(root: Path, pins: tuple[str, ...]) -> None:
    staging = root.parent / f".{root.name}.{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        for cmd, timeout in (([sys.executable, "-m", "venv", staging], 300),
                             ([staging / "bin" / "python", "-m", "pip", "install", "--quiet",
                               "--no-compile", "--disable-pip-version-check", *pins],
                              INSTALL_TIMEOUT)):
            proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True,
                                  timeout=timeout)
            if proc.returncode != 0:
                raise RuntimeError(f"`{' '.join(map(str, cmd))}` failed "
                                   f"(exit {proc.returncode}):\n"
                                   f"{(proc.stdout + proc.stderr).strip()[-3000:]}")
        (staging / ".ready").write_text("\n".join(pins) + "\n")
        shutil.rmtree(root, ignore_errors=True)
        staging.rename(root)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def ensure_peer_tools() -> Path:
    """The environment's bin/ folder (vllm-router, guidellm, python with sglang_router)."""
    return _ensure(PINS, "peers")


def ensure_clients() -> Path:
    """The clients' environment's bin/ folder (python with langchain_openai and agents)."""
    return _ensure(CLIENT_PINS, "clients")


def _ensure(pins: tuple[str, ...], name: str) -> Path:
    root = env_dir(pins, name)
    if not _ready(root):
        root.parent.mkdir(parents=True, exist_ok=True)
        with open(root.parent / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not _ready(root):
                started = time.monotonic()
                _build(root, pins)
                print(f"built {root} in {time.monotonic() - started:.0f} s", file=sys.stderr)
    # Console scripts carry the staging path in their #! line after the rename: run them
    # through the environment's python (see `command`).
    return root / "bin"


def command(bin_dir: Path, script: str) -> list[str]:
    """argv that runs an installed console script with the environment's interpreter."""
    return [str(bin_dir / "python"), str(bin_dir / script)]
