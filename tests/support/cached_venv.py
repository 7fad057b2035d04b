"""Virtual environments the tests build once into the cache (vLLM's parser, vLLM's server):
marked `.ready` only when complete, built by one process at a time under a file lock."""

from __future__ import annotations

import fcntl
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path


def python(root: Path) -> Path:
    return root / "bin" / "python"


def ready(root: Path) -> bool:
    return (root / ".ready").is_file() and python(root).exists()


def run(cmd: list, timeout: float) -> None:
    """Run a build step; its output is in the error when it fails."""
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(map(str, cmd))}` failed (exit {proc.returncode}):\n"
                           f"{(proc.stdout + proc.stderr).strip()[-3000:]}")


def ensure(root: Path, build: Callable[[Path], None]) -> Path:
    """The python of the venv at `root`, calling `build(root)` first unless it is ready; `build`
    writes `root/.ready` last."""
    if not ready(root):
        root.parent.mkdir(parents=True, exist_ok=True)
        with open(root.parent / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not ready(root):  # another process may have built it while we waited
                started = time.monotonic()
                build(root)
                print(f"built {root} in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return python(root)
