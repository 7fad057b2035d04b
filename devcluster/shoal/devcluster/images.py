"""The cluster's images, built here without a Docker daemon, cached as archives.

- base: the Dockerfile's `FROM` (python:3.11.7-slim-bookworm) cannot be pulled (no registry), so
  it is made locally: a debootstrap'd bookworm with Debian's python3 (rootfs tarball cached),
  imported with `podman import` under the tag the Dockerfile names.
- operator, engine, router: `buildah bud --isolation chroot` of the repository's Dockerfile
  targets, unchanged (`docker build` builds the same file). The CPU torch wheel that pip finds on
  this machine (and its dependencies) is given to the engine's build as a PEP 503 tree mounted
  read-only at build time and named by TORCH_INDEX_URL=file://...; the host's CA bundle is
  mounted too, so pip trusts the package index.
- pause: the static `pause` from build.sh in an image FROM scratch.
- model images (oci:// models): a model directory at /models on the python base (KServe's
  modelcar layout; the base has `sh` and `cp`, which the operator's copy step runs), under the
  caller's tag, loaded into the running cluster's nodes (docs/models.md).

Each built image is saved as a docker-archive named by a hash of its inputs (the Dockerfile and
what it copies: every source root), so a warm run neither builds nor saves; loading into a node
is skipped when the node already holds that archive's image.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path

from shoal.devcluster.layout import REPO, cache_root
from shoal.devcluster.procs import DevClusterError, log, run, run_logged

PYTHON_BASE_TAG = "docker.io/library/python:3.11.7-slim-bookworm"
OPERATOR_TAG = "ghcr.io/shoal-dev/shoal-operator:0.1.0"
ENGINE_TAG = "ghcr.io/shoal-dev/shoal:0.1.0"
ROUTER_TAG = "ghcr.io/shoal-dev/shoal-router:0.1.0"  # frontends and the gateway: no torch
PAUSE_TAG = "localhost/shoal/pause:3.4.1"
TORCH_VERSION = "2.13.0"
ROOTFS_RECIPE = "1"
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
# What the Dockerfile copies (its build context after .dockerignore): the image's content hash.
CONTEXT_PATHS = ("Dockerfile", "pyproject.toml", "setup.py", "README.md", "contract", "engine",
                 "router", "operator", "fetch", "cli", "supervisor", "images/healthcheck.py")
# The Dockerfile's targets the cluster runs, by the name of the archive each is saved as.
TARGETS = {"operator": OPERATOR_TAG, "engine": ENGINE_TAG, "router": ROUTER_TAG}


def images_dir() -> Path:
    d = cache_root() / "images"
    d.mkdir(parents=True, exist_ok=True)
    return d


def storage_args() -> list[str]:
    """buildah/podman use a store inside the cache (layers reused across runs)."""
    return ["--root", str(images_dir() / "storage"), "--runroot", "/run/shoal-buildah",
            "--storage-driver", "overlay"]


# -- base image ------------------------------------------------------------------------------
def ensure_rootfs() -> Path:
    """bookworm minbase + python3, as a tarball (debootstrap ~110 s, once per cache)."""
    tarball = images_dir() / f"rootfs-bookworm-python-r{ROOTFS_RECIPE}.tar"
    if tarball.is_file():
        return tarball
    work = images_dir() / "rootfs.tmp"
    if work.exists():
        shutil.rmtree(work)
    mirror = os.environ.get("SHOAL_DEBIAN_MIRROR", "http://deb.debian.org/debian")
    log(f"debootstrap bookworm ({mirror}) -> {work} (about 2 minutes, once)")
    run_logged(["nice", "-n", "10", "debootstrap", "--variant=minbase",
                "--include=python3,python3-venv,python3-pip,ca-certificates,netbase",
                "bookworm", str(work), mirror],
               images_dir() / "debootstrap.log", what="debootstrap")
    # What the python image has and Debian's python3 lacks: `python`/`pip` on PATH, and pip
    # allowed to install into a venv-less interpreter (the Dockerfile makes its own venv anyway).
    for name, target in (("python", "python3"), ("pip", "pip3")):
        link = work / "usr/local/bin" / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.exists():
            link.symlink_to(f"/usr/bin/{target}")
    for marker in (work / "usr/lib").glob("python3*/EXTERNALLY-MANAGED"):
        marker.unlink()
    shutil.rmtree(work / "var/cache/apt/archives", ignore_errors=True)
    (work / "var/cache/apt/archives/partial").mkdir(parents=True, exist_ok=True)
    for lists in (work / "var/lib/apt/lists").glob("*_*"):
        lists.unlink()
    tmp = tarball.with_suffix(".tar.tmp")
    run(["tar", "-C", str(work), "--numeric-owner", "-cf", str(tmp), "."])
    os.replace(tmp, tarball)
    shutil.rmtree(work)
    log(f"rootfs cached: {tarball} ({tarball.stat().st_size >> 20} MiB)")
    return tarball


def image_exists(tag: str) -> bool:
    return run(["podman", *storage_args(), "image", "exists", tag], check=False).returncode == 0


def ensure_base() -> None:
    if image_exists(PYTHON_BASE_TAG):
        return
    tarball = ensure_rootfs()
    log(f"podman import {tarball.name} as {PYTHON_BASE_TAG}")
    run(["podman", *storage_args(), "import", "--change", 'CMD ["python3"]', str(tarball),
         PYTHON_BASE_TAG], timeout=600)


# -- torch for the build ----------------------------------------------------------------------
def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def torch_index() -> Path:
    """A PEP 503 tree (one directory per project) with the CPU torch wheel and its
    dependencies, downloaded once with the host's pip configuration (which finds the wheel)."""
    root = images_dir() / f"torch-index-{TORCH_VERSION}"
    if (root / ".complete").is_file():
        if not (root / "index.html").is_file():
            write_index_pages(root)
        return root
    dl = images_dir() / "torch-download"
    dl.mkdir(exist_ok=True)
    log(f"pip download torch=={TORCH_VERSION} and its dependencies (once)")
    run_logged(["python3", "-m", "pip", "download", "--only-binary=:all:", "--dest", str(dl),
                f"torch=={TORCH_VERSION}"], images_dir() / "torch-download.log",
               what="pip download torch")
    if root.exists():
        shutil.rmtree(root)
    for wheel in dl.glob("*.whl"):
        project = _normalize(wheel.name.split("-")[0])
        (root / project).mkdir(parents=True, exist_ok=True)
        os.link(wheel, root / project / wheel.name)
    if not list(root.glob("torch/torch-*.whl")):
        raise DevClusterError(f"pip download put no torch wheel in {dl}")
    write_index_pages(root)
    (root / ".complete").write_text("ok\n")
    return root


INDEX_MOUNT = "/mnt/shoal-torch-index"


def write_index_pages(root: Path) -> None:
    """index.html per project (PEP 503), so pip reads the tree as a file:// index."""
    projects = sorted(d for d in root.iterdir() if d.is_dir())
    for d in projects:
        links = "".join(f'<a href="{w.name}">{w.name}</a>\n' for w in sorted(d.glob("*.whl")))
        (d / "index.html").write_text(f"<!DOCTYPE html><html><body>\n{links}</body></html>\n")
    links = "".join(f'<a href="{d.name}/">{d.name}</a>\n' for d in projects)
    (root / "index.html").write_text(f"<!DOCTYPE html><html><body>\n{links}</body></html>\n")


# -- Dockerfile targets -------------------------------------------------------------------------
def context_hash(target: str) -> str:
    h = hashlib.sha256(f"target={target}\ntorch={TORCH_VERSION}\n".encode())
    for rel in CONTEXT_PATHS:
        p = REPO / rel
        files = [p] if p.is_file() else sorted(
            f for f in p.rglob("*") if f.is_file() and "__pycache__" not in f.parts
            and not f.name.endswith(".pyc") and ".egg-info" not in str(f))
        for f in files:
            h.update(str(f.relative_to(REPO)).encode() + b"\0")
            h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()[:16]


def archive_path(target: str) -> Path:
    return images_dir() / f"{target}-{context_hash(target)}.tar"


def build_target(target: str, tag: str) -> Path:
    """The archive of one Dockerfile target, built unless an archive for these inputs exists."""
    archive = archive_path(target)
    if archive.is_file():
        log(f"image {target}: cached ({archive.name})")
        return archive
    ensure_base()
    args = [f"--build-arg=PYTHON_IMAGE={PYTHON_BASE_TAG}"]
    if target == "engine":
        # The wheel tree is mounted at build time and named by a fixed file:// URL, so the
        # torch layer's cache key does not change from one build to the next.
        args += ["-v", f"{torch_index()}:{INDEX_MOUNT}:ro",
                 f"--build-arg=TORCH_INDEX_URL=file://{INDEX_MOUNT}/"]
    logp = images_dir() / f"build-{target}.log"
    logp.write_text("")
    log(f"buildah bud --target {target} (log {logp})")
    run_logged(["nice", "-n", "10", "buildah", *storage_args(), "bud", "--isolation", "chroot",
                "--pull-never", "--layers", "--format", "docker", "--target", target,
                "-v", f"{CA_BUNDLE}:{CA_BUNDLE}:ro", *args, "-t", tag, str(REPO)],
               logp, what=f"image {target}: build")
    return _save_archive(tag, archive, f"{target}-*.tar", f"image {target}")


def _save_archive(tag: str, archive: Path, earlier: str, what: str) -> Path:
    """Save a built image as `archive` (atomically), dropping all but the newest of the older
    archives matching `earlier`: a running cluster may still load that one."""
    for old in sorted(images_dir().glob(earlier), key=lambda p: p.stat().st_mtime)[:-1]:
        old.unlink()
    tmp = archive.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    log(f"{what}: saving {tag} -> {archive.name}")
    run(["buildah", *storage_args(), "push", tag, f"docker-archive:{tmp}:{tag}"], timeout=900)
    os.replace(tmp, archive)
    return archive


def prune_store() -> None:
    """Drop the layer chains of earlier builds (untagged, no children) from the build store;
    about 0.1 s when there are none.

    Each rebuild of a target leaves its previous chain behind: 1.8 GB per engine build, 41 GB
    after a day of work, which pushed the host disk into the nodes' eviction threshold. The
    chains under the current tags stay, so the next build still reuses its torch layer."""
    free = shutil.disk_usage(images_dir()).free
    run(["podman", *storage_args(), "image", "prune", "--force"], timeout=1800)
    freed = shutil.disk_usage(images_dir()).free - free
    if freed > 64 << 20:
        log(f"build store: removed earlier builds' layers ({freed >> 20} MiB freed)")


def build_pause(pause_bin: Path) -> Path:
    digest = hashlib.sha256(pause_bin.read_bytes()).hexdigest()[:16]
    archive = images_dir() / f"pause-{digest}.tar"
    if archive.is_file():
        return archive
    log(f"image pause: FROM scratch + {pause_bin}")
    ctr = run(["buildah", *storage_args(), "from", "scratch"]).stdout.decode().strip()
    try:
        run(["buildah", *storage_args(), "copy", "--chmod", "0755", ctr, str(pause_bin), "/pause"])
        run(["buildah", *storage_args(), "config", "--entrypoint", '["/pause"]', ctr])
        run(["buildah", *storage_args(), "commit", "--format", "docker", ctr, PAUSE_TAG])
    finally:
        run(["buildah", *storage_args(), "rm", ctr], check=False)
    tmp = archive.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    run(["buildah", *storage_args(), "push", PAUSE_TAG, f"docker-archive:{tmp}:{PAUSE_TAG}"])
    os.replace(tmp, archive)
    return archive


# -- into a node --------------------------------------------------------------------------------
TAGS = {"pause": PAUSE_TAG, **TARGETS}


def node_images(sock: Path) -> set[str]:
    """The image names this node's containerd holds (the kubelet's namespace)."""
    out = run(["ctr", "-a", str(sock), "-n", "k8s.io", "images", "list", "--quiet"]).stdout
    return set(out.decode().split())


def needs_import(held: set[str], store: Path, archive: Path, what: str,
                 tag: str | None = None) -> bool:
    """False when this node already imported this very archive and still holds its image
    (`held`: node_images; a kubelet under disk pressure deletes unused images, marker or not).
    `tag` is the image's name (default: TAGS[what])."""
    tag = tag or TAGS[what]
    marker = store / "loaded" / what
    if not (marker.is_file() and marker.read_text() == archive.name):
        return True
    if tag in held:
        return False
    log(f"{store.name}: {tag} was imported before but is gone (the kubelet deletes "
        "unused images when the disk runs short); importing it again")
    return True


def import_into_node(sock: Path, store: Path, archive: Path, what: str) -> None:
    log(f"{store.name}: importing {archive.name} ({archive.stat().st_size >> 20} MiB)")
    run(["ctr", "-a", str(sock), "-n", "k8s.io", "images", "import", str(archive)], timeout=900)
    marker = store / "loaded" / what
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(archive.name)


def build_all() -> dict[str, Path]:
    """Every target's archive by target name, each built unless cached."""
    return {target: build_target(target, tag) for target, tag in TARGETS.items()}


# -- model images (oci://) -----------------------------------------------------------------------
MODEL_MOUNT = "/models"  # KServe's modelcar convention: the model directory inside the image
MODEL_RECIPE = "1"


def model_files(model_dir: Path) -> list[Path]:
    """The files of a model directory that go into its image (names starting with "." do not:
    build stamps and caches), sorted."""
    model_dir = Path(model_dir)
    return sorted(p for p in model_dir.rglob("*") if p.is_file() and not any(
        part.startswith(".") for part in p.relative_to(model_dir).parts))


def model_hash(model_dir: Path, tag: str) -> str:
    """What names a model image's archive: the recipe, the base, the tag and every file's path
    and content (not its mtime: a rebuilt identical model reuses the archive)."""
    h = hashlib.sha256(f"model-image={MODEL_RECIPE}\nbase={PYTHON_BASE_TAG}\ntag={tag}\n"
                       .encode())
    for f in model_files(model_dir):
        h.update(str(f.relative_to(model_dir)).encode() + b"\0")
        fh = hashlib.sha256()
        with open(f, "rb") as src:
            while chunk := src.read(8 << 20):
                fh.update(chunk)
        h.update(fh.digest())
    return h.hexdigest()[:16]


def model_containerfile(digest: str) -> str:
    """The model image's build file: the model at MODEL_MOUNT, owned by root and readable by
    every user (the engine runs as 10001), nothing run at build time."""
    return (f"FROM {PYTHON_BASE_TAG}\n"
            f"COPY --chown=0:0 model/ {MODEL_MOUNT}/\n"
            f"LABEL dev.shoal.model-hash={digest} org.opencontainers.image.title=shoal-model\n")


def _model_context(model_dir: Path, work: Path, digest: str) -> None:
    """Containerfile + model/: files of mode 0644 hard-linked (no copy of the weights), others
    copied and made 0644, directories 0755, so the image does not depend on a umask."""
    (work / "Containerfile").write_text(model_containerfile(digest))
    for f in model_files(model_dir):
        dst = work / "model" / f.relative_to(model_dir)
        dst.parent.mkdir(parents=True, exist_ok=True)
        if f.stat().st_mode & 0o777 == 0o644:
            try:
                os.link(f, dst)
                continue
            except OSError:
                pass
        shutil.copyfile(f, dst)
        os.chmod(dst, 0o644)
    for d in [work / "model", *(p for p in (work / "model").rglob("*") if p.is_dir())]:
        os.chmod(d, 0o755)


def _tag_slug(tag: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", tag)


def build_model_image(model_dir: Path, tag: str) -> Path:
    """The docker-archive of an image holding `model_dir` at /models under `tag`, built with
    buildah on the python base unless an archive for these files and tag exists."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise DevClusterError(f"{model_dir} is not a model directory (no config.json)")
    digest = model_hash(model_dir, tag)
    archive = images_dir() / f"model-{_tag_slug(tag)}-{digest}.tar"
    if archive.is_file():
        log(f"model image {tag}: cached ({archive.name})")
        return archive
    ensure_base()
    work = images_dir() / f"model-{digest}.context"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        _model_context(model_dir, work, digest)
        logp = images_dir() / f"build-model-{digest}.log"
        log(f"model image {tag}: buildah bud {model_dir} (log {logp})")
        run_logged(["nice", "-n", "10", "buildah", *storage_args(), "bud", "--isolation",
                    "chroot", "--pull-never", "--format", "docker", "-f",
                    str(work / "Containerfile"), "-t", tag, str(work)],
                   logp, what=f"model image {tag}: build")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return _save_archive(tag, archive, f"model-{_tag_slug(tag)}-*.tar", f"model image {tag}")


def load_into_nodes(archive: Path, tag: str, what: str) -> list[str]:
    """Import an image archive into every node of the running cluster (each skipped when it
    already holds it, as the start does for the cluster's own images); the nodes that imported.
    `what` names the archive's marker in each node's store (one per image kind)."""
    from shoal.devcluster.layout import nodes

    loaded = []
    for n in nodes():
        if not n.sock.exists():
            raise DevClusterError(f"{n.name}: no containerd at {n.sock} (is the cluster up? "
                                  "python -m shoal.devcluster start)")
        if needs_import(node_images(n.sock), n.store, archive, what, tag):
            import_into_node(n.sock, n.store, archive, what)
            loaded.append(n.name)
    return loaded


def ensure_model_image(model_dir: Path, tag: str) -> Path:
    """Build (cached) and load into the running cluster's nodes: what an oci:// model test
    calls before it names `oci://TAG` in an InferenceEngine (imagePullPolicy IfNotPresent: no
    registry serves it)."""
    archive = build_model_image(model_dir, tag)
    load_into_nodes(archive, tag, f"model-{_tag_slug(tag)}")
    return archive
