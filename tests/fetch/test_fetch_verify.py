"""What a complete snapshot is: sizes and hashes against the hub's metadata, the record that
spares hashing twice, and the bytes a progress line counts."""

from __future__ import annotations

import hashlib
import os

import pytest
from huggingface_hub.hf_api import BlobLfsInfo, RepoSibling
from shoal.fetch import verify
from shoal.fetch.progress import bytes_present
from shoal.fetch.verify import Expected

WEIGHTS = b"\x01" * 4096
CONFIG = b'{"hidden_size": 256}'
COMMIT = "c" * 40


def git_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


EXPECTED = (
    Expected("model.safetensors", len(WEIGHTS), "p" * 40, hashlib.sha256(WEIGHTS).hexdigest()),
    Expected("config.json", len(CONFIG), git_id(CONFIG)),
)


def put(cache, files: dict[str, bytes], commit: str = COMMIT) -> None:
    """A snapshot laid out as huggingface_hub lays it out: blobs by etag, relative links."""
    storage = verify.storage_folder(cache, "acme/llama")
    (storage / "blobs").mkdir(parents=True, exist_ok=True)
    snap = storage / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    for e in EXPECTED:
        if e.name in files:
            (storage / "blobs" / e.etag).write_bytes(files[e.name])
            os.symlink(f"../../blobs/{e.etag}", snap / e.name)


def test_engine_files_from_model_info_siblings() -> None:
    siblings = [
        RepoSibling("model.safetensors", 10, "p" * 40, BlobLfsInfo(10, "a" * 64, 134)),
        RepoSibling("config.json", 5, "b" * 40),
        RepoSibling("pytorch_model.bin", 99, "d" * 40, BlobLfsInfo(99, "e" * 64, 134)),
        RepoSibling("README.md", 3, "f" * 40),
    ]
    assert verify.expected_files(siblings) == (
        Expected("model.safetensors", 10, "p" * 40, "a" * 64),
        Expected("config.json", 5, "b" * 40, None),
    )
    assert verify.expected_files(siblings)[0].etag == "a" * 64  # LFS blobs: named by sha256


def test_sizes_are_required() -> None:
    with pytest.raises(ValueError, match="config.json"):
        verify.expected_files([RepoSibling("config.json")])


def test_a_complete_snapshot_has_no_problems(tmp_path) -> None:
    put(tmp_path, {"model.safetensors": WEIGHTS, "config.json": CONFIG})
    assert verify.check(verify.snapshot_dir(tmp_path, "acme/llama", COMMIT), EXPECTED) == []


@pytest.mark.parametrize(("files", "name", "what"), [
    ({"config.json": CONFIG}, "model.safetensors", "missing"),
    ({"model.safetensors": WEIGHTS[:-1], "config.json": CONFIG}, "model.safetensors",
     "size 4095, expected 4096"),
    ({"model.safetensors": b"\x02" * 4096, "config.json": CONFIG}, "model.safetensors",
     "sha256"),
    ({"model.safetensors": WEIGHTS, "config.json": CONFIG.replace(b"256", b"512")},
     "config.json", "git blob id"),
])
def test_problems_name_the_file_and_the_fault(tmp_path, files, name, what) -> None:
    put(tmp_path, files)
    problems = verify.check(verify.snapshot_dir(tmp_path, "acme/llama", COMMIT), EXPECTED)
    assert [p.name for p in problems] == [name]
    assert what in problems[0].what


def test_a_bad_file_is_deleted_blob_and_link(tmp_path) -> None:
    put(tmp_path, {"model.safetensors": b"\x02" * 4096, "config.json": CONFIG})
    snap = verify.snapshot_dir(tmp_path, "acme/llama", COMMIT)
    [problem] = verify.check(snap, EXPECTED)
    blob = (snap / "model.safetensors").resolve()
    verify.remove_bad(problem)
    assert not blob.exists() and not (snap / "model.safetensors").is_symlink()
    assert (snap / "config.json").is_file()


def test_the_record_holds_until_a_file_changes(tmp_path) -> None:
    put(tmp_path, {"model.safetensors": WEIGHTS, "config.json": CONFIG})
    assert not verify.record_holds(tmp_path, "acme/llama", COMMIT, EXPECTED)
    verify.write_record(tmp_path, "acme/llama", COMMIT, EXPECTED)
    assert verify.record_holds(tmp_path, "acme/llama", COMMIT, EXPECTED)
    assert verify.recorded_files(tmp_path, "acme/llama", COMMIT) == EXPECTED
    blob = (verify.snapshot_dir(tmp_path, "acme/llama", COMMIT) / "model.safetensors").resolve()
    replacement = blob.with_suffix(".new")
    replacement.write_bytes(b"\x02" * 4096)  # same size, other content, another inode
    os.replace(replacement, blob)
    assert not verify.record_holds(tmp_path, "acme/llama", COMMIT, EXPECTED)


def test_progress_counts_complete_and_partial_blobs(tmp_path) -> None:
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    assert bytes_present(blobs, EXPECTED) == 0
    (blobs / f"{EXPECTED[0].etag}.1a2b3c4d.incomplete").write_bytes(WEIGHTS[:1000])
    assert bytes_present(blobs, EXPECTED) == 1000
    (blobs / EXPECTED[1].etag).write_bytes(CONFIG)
    assert bytes_present(blobs, EXPECTED) == 1000 + len(CONFIG)
    assert bytes_present(tmp_path / "absent", EXPECTED) == 0
