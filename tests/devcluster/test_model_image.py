"""The oci:// model image's pure parts: its build file, what names its archive, its context."""

from __future__ import annotations

import os
import stat

from shoal.devcluster import images

TAG = "localhost/shoal/model-tiny:1"


def model(tmp_path, **files: bytes):
    d = tmp_path / "m"
    d.mkdir(exist_ok=True)
    for name, data in {"config.json": b"{}", "model.safetensors": b"\0" * 64, **files}.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(data)
        os.chmod(d / name, 0o644)
    return d


def test_containerfile_puts_the_model_at_models_on_the_python_base() -> None:
    assert images.model_containerfile("abc123") == (
        f"FROM {images.PYTHON_BASE_TAG}\n"
        "COPY --chown=0:0 model/ /models/\n"
        "LABEL dev.shoal.model-hash=abc123 org.opencontainers.image.title=shoal-model\n")
    assert images.MODEL_MOUNT == "/models"  # KServe's modelcar layout


def test_hidden_files_are_not_part_of_the_model(tmp_path) -> None:
    d = model(tmp_path, **{".shoal-model-format": b"2", "sub/tokenizer.json": b"{}"})
    (d / ".cache").mkdir()
    (d / ".cache" / "x.lock").write_text("")
    assert [p.relative_to(d).as_posix() for p in images.model_files(d)] == [
        "config.json", "model.safetensors", "sub/tokenizer.json"]


def test_the_hash_follows_content_names_and_tag_not_mtimes(tmp_path) -> None:
    d = model(tmp_path)
    first = images.model_hash(d, TAG)
    os.utime(d / "model.safetensors", (1, 1))
    (d / ".stamp").write_text("ignored")
    assert images.model_hash(d, TAG) == first
    assert images.model_hash(d, "localhost/shoal/model-tiny:2") != first
    (d / "model.safetensors").write_bytes(b"\1" * 64)
    second = images.model_hash(d, TAG)
    assert second != first
    (d / "model.safetensors").rename(d / "model-00001.safetensors")
    assert images.model_hash(d, TAG) != second


def test_the_context_holds_the_model_readable_by_every_user(tmp_path) -> None:
    d = model(tmp_path, **{"sub/tokenizer.json": b"{}"})
    os.chmod(d / "config.json", 0o600)  # private on the host: copied, made readable
    work = tmp_path / "ctx"
    work.mkdir()
    images._model_context(d, work, "abc123")
    assert (work / "Containerfile").read_text() == images.model_containerfile("abc123")
    got = {p.relative_to(work / "model").as_posix(): stat.S_IMODE(p.stat().st_mode)
           for p in (work / "model").rglob("*")}
    assert got == {"config.json": 0o644, "model.safetensors": 0o644, "sub": 0o755,
                   "sub/tokenizer.json": 0o644}
    assert (work / "model" / "config.json").read_bytes() == b"{}"
    assert (d / "config.json").stat().st_mode & 0o777 == 0o600  # the host's file untouched
    assert (work / "model" / "model.safetensors").stat().st_ino == \
        (d / "model.safetensors").stat().st_ino  # the weights are linked, not copied


def test_a_node_imports_a_model_image_once_and_again_when_it_is_gone(tmp_path) -> None:
    archive = tmp_path / "model-x-1.tar"
    archive.write_text("")
    store = tmp_path / "store"
    (store / "loaded").mkdir(parents=True)
    assert images.needs_import(set(), store, archive, "model-x", TAG)
    (store / "loaded" / "model-x").write_text(archive.name)
    assert not images.needs_import({TAG}, store, archive, "model-x", TAG)
    assert images.needs_import(set(), store, archive, "model-x", TAG)
