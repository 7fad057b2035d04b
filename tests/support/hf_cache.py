"""A Hugging Face cache entry written the documented way, for tests that resolve hub ids offline.

huggingface_hub has no public writer for its cache short of downloading, so this writes the
layout its docs describe (huggingface.co/docs/huggingface_hub/guides/manage-cache):
`models--ORG--NAME/blobs/<hash>` (sha256 for LFS files, the git blob id for the rest),
`snapshots/<commit>/<file>` as relative symlinks to the blobs, and `refs/<revision>` holding the
commit. Tests check it with the real `huggingface_hub.scan_cache_dir()`, and the real
`snapshot_download` reads it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

LFS_SUFFIXES = (".safetensors", ".bin", ".model")


def _blob_id(data: bytes, lfs: bool) -> str:
    if lfs:
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def write_snapshot(cache: Path, repo_id: str, files: Path, commit: str,
                   refs: tuple[str, ...] = ("main",), skip: tuple[str, ...] = ()) -> Path:
    """The files of directory `files` (top level, minus `skip`) as snapshot `commit` of
    `repo_id` in `cache`, each ref in `refs` pointing at it; the snapshot directory."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    blobs, snapshot = repo / "blobs", repo / "snapshots" / commit
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for src in sorted(files.iterdir()):
        if not src.is_file() or src.name.startswith(".") or src.name in skip:
            continue
        data = src.read_bytes()
        blob = blobs / _blob_id(data, src.name.endswith(LFS_SUFFIXES))
        if not blob.exists():
            blob.write_bytes(data)
        link = snapshot / src.name
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(blob, snapshot))
    for ref in refs:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot
