"""`shoal make-model` writes a model directory that another user can read.

Why: the engine image runs as uid 10001 and mounts the model read-only; `model.safetensors`
came out 0600 (root's), and the engine died with an error that read like a missing model.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

pytest.importorskip("transformers")


def test_make_model_files_are_world_readable(tmp_path: Path) -> None:
    from shoal.engine.model_maker import make_model

    old = os.umask(0o022)
    try:
        out = make_model(tmp_path / "m", size="tiny")
    finally:
        os.umask(old)
    assert (out / "model.safetensors").is_file()
    private = []
    for path in [out, *out.rglob("*")]:
        mode = path.stat().st_mode
        need = stat.S_IROTH | (stat.S_IXOTH if path.is_dir() else 0)
        if mode & need != need:
            private.append(f"{path.relative_to(tmp_path)} {stat.filemode(mode)}")
    assert not private, ("not readable by other users (the engine image's uid 10001):\n"
                         + "\n".join(private))
