"""One fetch: learn the files from the hub, download what the cache lacks, verify, record.

Under the repository's lock (lock.py):
1. A fetch that waits for another prints the holder's progress meanwhile (every waiting pod's
   status shows the download), then trusts the record that one wrote while it waited (the same
   commit, the same files by stat) and answers "cached" without calling the hub: N ranks of M
   groups sharing a cache make one set of hub calls, not N x M.
2. Otherwise `model_info(files_metadata=True)` gives the commit and every engine file's size and
   hash. A snapshot whose files match (a record, or hashing them once) is "cached". When the
   hub cannot be reached (a transient fault, never a refusal or a not-found) and the cache holds
   a snapshot verified for this revision, that one is "cached", said so: an engine offline
   would serve it anyway, and a pod restarting during a hub outage still starts.
3. Otherwise `snapshot_download` at that commit (so the metadata and the files agree even when
   the branch moves meanwhile), progress lines meanwhile, then every file is checked; a bad file's
   blob is deleted (HashMismatch: transient, the next try downloads it again).
The revision's ref (refs/REVISION -> commit) is written last, so an offline reader (`shoal serve
ORG/NAME --download-dir DIR`, vLLM) resolves the revision only to a verified snapshot.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from shoal.contract.model_fetch import ENGINE_FILES, HubRef, progress_line
from shoal.fetch import verify
from shoal.fetch.errors import HashMismatch, NoEngineFiles, is_transient
from shoal.fetch.lock import lock_path, repo_lock
from shoal.fetch.progress import Reporter, bytes_present

_COMMIT = re.compile(r"[0-9a-f]{40}")
_GIB = 1024 ** 3


@dataclass(frozen=True)
class Result:
    commit: str
    files: int
    total_bytes: int
    downloaded_bytes: int  # 0 when cached
    seconds: float
    cached: bool


def write_ref(cache_dir: str | os.PathLike, ref: HubRef, commit: str) -> None:
    """refs/REVISION -> commit, atomically, as huggingface_hub writes it (no newline)."""
    if ref.revision == commit:
        return
    path = verify.storage_folder(cache_dir, ref.repo_id) / "refs" / ref.revision
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_file() and path.read_text() == commit:
        return
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(commit)
    os.replace(tmp, path)


def read_ref(cache_dir: str | os.PathLike, ref: HubRef) -> str | None:
    if _COMMIT.fullmatch(ref.revision):
        return ref.revision
    try:
        text = (verify.storage_folder(cache_dir, ref.repo_id) / "refs" / ref.revision).read_text()
    except OSError:
        return None
    return text.strip() if _COMMIT.fullmatch(text.strip()) else None


def inflight_path(cache_dir, ref: HubRef) -> Path:
    """What the fetch holding the lock is downloading (for the ones waiting: their progress)."""
    return lock_path(cache_dir, ref).with_name("shoal-fetch.inflight.json")


def _write_inflight(path: Path, commit: str, expected) -> None:
    files = [[e.name, e.size, e.blob_id, e.sha256] for e in expected]
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"commit": commit, "files": files}))
    os.replace(tmp, path)


def _holder_progress(cache_dir, ref: HubRef) -> str | None:
    """The progress line of the fetch this one waits for, or None (it has not started)."""
    try:
        data = json.loads(inflight_path(cache_dir, ref).read_text())
        expected = tuple(verify.Expected(*entry) for entry in data["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    blobs = verify.storage_folder(cache_dir, ref.repo_id) / "blobs"
    return progress_line(ref, bytes_present(blobs, expected), sum(e.size for e in expected))


def _gib(n: int) -> str:
    return f"{n / _GIB:.2f} GiB"


def _verified(cache_dir, ref: HubRef, since: float | None = None,
              patterns: tuple[str, ...] = ENGINE_FILES) -> Result | None:
    """The snapshot refs/REVISION names, when its record (written since `since`, if given)
    still holds and has weights if `patterns` asks for them (a tokenizer-only fetch into the
    same cache must not pass for an engine's); None otherwise."""
    commit = read_ref(cache_dir, ref)
    if commit is None:
        return None
    record = verify.record_path(cache_dir, ref.repo_id, commit)
    try:
        fresh = since is None or record.stat().st_mtime >= since - 1.0
    except OSError:
        return None
    files = verify.recorded_files(cache_dir, ref.repo_id, commit) if fresh else None
    if not files or not verify.record_holds(cache_dir, ref.repo_id, commit, files):
        return None
    if "*.safetensors" in patterns and not any(f.name.endswith(".safetensors") for f in files):
        return None
    return Result(commit, len(files), sum(f.size for f in files), 0, 0.0, True)


def fetch(ref: HubRef, cache_dir: str | os.PathLike, *, token: str | None,
          emit: Callable[[str], None], max_workers: int = 8,
          patterns: tuple[str, ...] = ENGINE_FILES) -> Result:
    """Fetch `ref`'s files that `patterns` keep (FILE_SETS) into `cache_dir` (a huggingface_hub
    cache); raises what the hub raised, or HashMismatch / NoEngineFiles."""
    from huggingface_hub import HfApi, snapshot_download

    say = lambda text: emit(f"fetch {ref.repo_id}@{ref.revision}: {text}")  # noqa: E731
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    def report_holder() -> None:
        line = _holder_progress(cache_dir, ref)
        if line is not None:
            emit(line)

    with repo_lock(cache_dir, ref, on_wait=lambda p: say(f"waiting for another fetch ({p})"),
                   while_waiting=report_holder) as held:
        if held.waited:
            done = _verified(cache_dir, ref, since=held.wait_began, patterns=patterns)
            if done is not None:
                say(f"cached (commit {done.commit[:12]}, {done.files} files, "
                    f"{_gib(done.total_bytes)}, verified by the fetch this one waited "
                    f"{held.waited_s:.1f} s for)")
                return done
        try:
            info = HfApi().model_info(ref.repo_id, revision=ref.revision, files_metadata=True,
                                      token=token)
        except Exception as exc:
            # The hub unreachable or failing (never a refusal or a not-found): a snapshot this
            # cache verified for the revision serves, as an offline engine would serve it.
            done = _verified(cache_dir, ref, patterns=patterns) if is_transient(exc) else None
            if done is None:
                raise
            say(f"cached (commit {done.commit[:12]}, {done.files} files, "
                f"{_gib(done.total_bytes)}: the snapshot refs/{ref.revision} named when it was "
                f"verified; the hub is unreachable now: {type(exc).__name__})")
            return done
        commit = info.sha
        expected = verify.expected_files(info.siblings, patterns)
        if not expected:
            names = ", ".join(s.rfilename for s in (info.siblings or ())[:8]) or "none"
            raise NoEngineFiles(f"none of {', '.join(patterns)} among its files: {names}")
        total = sum(e.size for e in expected)
        snapshot = verify.snapshot_dir(cache_dir, ref.repo_id, commit)
        if verify.record_holds(cache_dir, ref.repo_id, commit, expected) or (
                snapshot.is_dir() and not verify.check(snapshot, expected)):
            verify.write_record(cache_dir, ref.repo_id, commit, expected)
            write_ref(cache_dir, ref, commit)
            say(f"cached (commit {commit[:12]}, {len(expected)} files, {_gib(total)})")
            return Result(commit, len(expected), total, 0, time.monotonic() - t0, True)
        blobs = verify.storage_folder(cache_dir, ref.repo_id) / "blobs"
        before = bytes_present(blobs, expected)
        say(f"start (commit {commit[:12]}, {len(expected)} files, {_gib(total)}, "
            f"{_gib(total - before)} to download)")
        inflight = inflight_path(cache_dir, ref)
        _write_inflight(inflight, commit, expected)
        try:
            with Reporter(ref, blobs, expected, emit):
                snapshot_download(ref.repo_id, revision=commit, cache_dir=str(cache_dir),
                                  allow_patterns=list(patterns), token=token,
                                  max_workers=max_workers)
        finally:
            inflight.unlink(missing_ok=True)
        bad = verify.check(snapshot, expected)
        for problem in bad:
            verify.remove_bad(problem)
        if bad:
            raise HashMismatch("; ".join(f"{p.name}: {p.what}" for p in bad))
        verify.write_record(cache_dir, ref.repo_id, commit, expected)
        write_ref(cache_dir, ref, commit)
        seconds = time.monotonic() - t0
        got = total - before
        say(f"done in {seconds:.1f} s (commit {commit[:12]}, {len(expected)} files, "
            f"{_gib(got)} downloaded, {got / _GIB / max(seconds, 1e-9):.2f} GiB/s)")
        return Result(commit, len(expected), total, got, seconds, False)

