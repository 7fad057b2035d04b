"""What a complete snapshot is, and whether the cache holds one.

The hub's file metadata (`model_info(files_metadata=True)`) gives every file's size, its git
blob id and, for LFS files (weights), the sha256 of its content. huggingface_hub checks only the
size of what it downloads; this module checks the content too, once: a verified snapshot leaves
a Record (each file's size, mtime and inode), and a later fetch that finds the same stat answers
"cached" without hashing gigabytes again.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from shoal.contract.model_fetch import ENGINE_FILES
from shoal.fetch.lock import repo_folder

_CHUNK = 8 << 20


@dataclass(frozen=True)
class Expected:
    """One file of the snapshot as the hub describes it."""

    name: str  # path in the repository
    size: int
    blob_id: str | None = None  # git object id (sha1 of "blob SIZE\\0" + content for plain files)
    sha256: str | None = None  # LFS files only

    @property
    def etag(self) -> str | None:
        """The blob's file name in the cache (huggingface_hub names blobs by their etag: the
        sha256 for LFS files, the git blob id for the rest)."""
        return self.sha256 or self.blob_id


def engine_files(names: Iterable[str], patterns: Iterable[str] = ENGINE_FILES) -> list[str]:
    """The names snapshot_download keeps with allow_patterns=`patterns` (its own filter)."""
    from huggingface_hub.utils import filter_repo_objects

    return list(filter_repo_objects(list(names), allow_patterns=list(patterns)))


def expected_files(siblings, patterns: Iterable[str] = ENGINE_FILES) -> tuple[Expected, ...]:
    """Expected files from model_info's siblings (RepoSibling), those `patterns` keep only.
    ValueError when the hub gave no size (model_info was called without files_metadata)."""
    by_name = {s.rfilename: s for s in siblings or ()}
    out = []
    for name in engine_files(by_name, patterns):
        s = by_name[name]
        if s.size is None:
            raise ValueError(f"the hub gave no size for {name}")
        out.append(Expected(name, int(s.size), s.blob_id, s.lfs.sha256 if s.lfs else None))
    return tuple(out)


def storage_folder(cache_dir: str | os.PathLike, repo_id: str) -> Path:
    return Path(cache_dir) / repo_folder(repo_id)


def snapshot_dir(cache_dir: str | os.PathLike, repo_id: str, commit: str) -> Path:
    return storage_folder(cache_dir, repo_id) / "snapshots" / commit


# -- checking ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Problem:
    name: str
    what: str  # "missing", "size 10, expected 12", "sha256 ab.., expected cd.."
    path: Path  # the snapshot's entry (a symlink into blobs/)


def _digest(path: Path, algo: str, prefix: bytes = b"") -> str:
    h = hashlib.new(algo)
    h.update(prefix)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def check_file(snapshot: Path, exp: Expected, *, hashes: bool = True) -> Problem | None:
    path = snapshot / exp.name
    if not path.exists():
        return Problem(exp.name, "missing", path)
    size = path.stat().st_size
    if size != exp.size:
        return Problem(exp.name, f"size {size}, expected {exp.size}", path)
    if not hashes:
        return None
    if exp.sha256:
        got = _digest(path, "sha256")
        if got != exp.sha256:
            return Problem(exp.name, f"sha256 {got[:12]}.., expected {exp.sha256[:12]}..", path)
    elif exp.blob_id and len(exp.blob_id) == 40:
        got = _digest(path, "sha1", b"blob %d\0" % size)
        if got != exp.blob_id:
            return Problem(exp.name, f"git blob id {got[:12]}.., expected {exp.blob_id[:12]}..",
                           path)
    return None


def check(snapshot: Path, expected: Iterable[Expected], *, hashes: bool = True) -> list[Problem]:
    """Every file that is missing or differs from what the hub says (empty: complete)."""
    return [p for e in expected if (p := check_file(snapshot, e, hashes=hashes)) is not None]


def remove_bad(problem: Problem) -> None:
    """Delete a bad file's blob and its snapshot link, so the next fetch downloads it again."""
    path = problem.path
    if path.is_symlink() or path.exists():
        blob = path.resolve()
        for p in (blob, path):
            try:
                p.unlink()
            except FileNotFoundError:
                pass


# -- the record of a verified snapshot -----------------------------------------------------------
def _stat(path: Path) -> list[int]:
    st = path.stat()  # through the link: the blob
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def record_path(cache_dir: str | os.PathLike, repo_id: str, commit: str) -> Path:
    return Path(cache_dir) / ".locks" / repo_folder(repo_id) / "shoal-verified" / f"{commit}.json"


def write_record(cache_dir, repo_id: str, commit: str, expected: Iterable[Expected]) -> Path:
    snap = snapshot_dir(cache_dir, repo_id, commit)
    files = {e.name: {"size": e.size, "blob_id": e.blob_id, "sha256": e.sha256,
                      "stat": _stat(snap / e.name)} for e in expected}
    path = record_path(cache_dir, repo_id, commit)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"commit": commit, "files": files}, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def read_record(cache_dir, repo_id: str, commit: str) -> dict | None:
    try:
        return json.loads(record_path(cache_dir, repo_id, commit).read_text())
    except (OSError, ValueError):
        return None


def _as_expected(name: str, entry: dict) -> Expected:
    return Expected(name, entry["size"], entry["blob_id"], entry["sha256"])


def record_holds(cache_dir, repo_id: str, commit: str, expected: Iterable[Expected]) -> bool:
    """True when a record says these very files (same metadata, size, mtime, inode) were
    verified."""
    rec = read_record(cache_dir, repo_id, commit)
    if rec is None:
        return False
    snap = snapshot_dir(cache_dir, repo_id, commit)
    try:
        for e in expected:
            entry = rec["files"].get(e.name)
            if entry is None or _as_expected(e.name, entry) != e or \
                    entry["stat"] != _stat(snap / e.name):
                return False
    except (OSError, KeyError, TypeError):
        return False
    return True


def recorded_files(cache_dir, repo_id: str, commit: str) -> tuple[Expected, ...] | None:
    """The files a record lists (for a fetch that waited on another and trusts its check)."""
    rec = read_record(cache_dir, repo_id, commit)
    try:
        return tuple(_as_expected(n, e) for n, e in rec["files"].items()) if rec else None
    except (KeyError, TypeError, AttributeError):
        return None
