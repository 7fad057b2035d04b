"""Fixtures for the project's own models, built once per cache directory.

Models are written to `$SHOAL_CACHE/models/<name>` (default `~/.cache/shoal`). Building happens
in a temporary sibling directory that is renamed into place, under an exclusive file lock, so two
pytest processes started at the same time neither race nor see a half-written model.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# Bump when model_maker changes what it writes, so stale caches are rebuilt, not reused.
MODEL_FORMAT = "2"  # 2: files readable by other users (share_readable)


def cache_dir() -> Path:
    return Path(os.environ.get("SHOAL_CACHE", Path.home() / ".cache" / "shoal"))


def ensure_model(name: str, size: str, arch: str = "llama") -> Path:
    """Return the path of a built model, building it first if this cache lacks it."""
    models = cache_dir() / "models"
    models.mkdir(parents=True, exist_ok=True)
    target = models / name
    stamp = target / ".shoal-model-format"
    with open(models / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # held until the with-block closes the file
        if stamp.is_file() and stamp.read_text() == MODEL_FORMAT:
            return target
        from shoal.engine.model_maker import make_model

        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=models))
        try:
            make_model(tmp, size=size, arch=arch)
            (tmp / ".shoal-model-format").write_text(MODEL_FORMAT)
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; other users/containers read it
            if target.exists():
                shutil.rmtree(target)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


@pytest.fixture(scope="session")
def tiny_model() -> str:
    """Path to the tiny Llama model (hidden 256, 4 layers): the one most tests use."""
    return str(ensure_model("shoal-tiny", "tiny"))


@pytest.fixture(scope="session")
def small_model() -> str:
    """Path to the small Llama model (hidden 768, 12 layers), for compute-bound checks."""
    return str(ensure_model("shoal-small", "small"))


@pytest.fixture(scope="session")
def tiny_qwen2_model() -> str:
    """Path to the tiny model's shapes as a Qwen2 architecture (q/k/v biases)."""
    return str(ensure_model("shoal-tiny-qwen2", "tiny", arch="qwen2"))
