"""What can be checked in the Dockerfiles without building them (no Docker daemon here):
targets exist, they run as a non-root user under tini, every COPY source exists and is in the
build context, base images are pinned, and the operator and router images never install torch."""

from __future__ import annotations

import glob
import re
import runpy

import pytest
from dockerfile_reader import Dockerfile, Stage, dockerignore, parse
from packaging_support import REPO

# Dockerfile -> the targets users build from it. The context is the repository root for all.
DOCKERFILES = {
    "Dockerfile": ["operator", "router", "engine"],
    "images/engine-cuda/Dockerfile": ["engine"],
}
# Images of peers' software built here for the tests, shaped like the peer's own image, not like
# Shoal's (vllm/vllm-openai runs `vllm serve` as root without tini; its context is its folder):
# docs/cluster.md, "The vLLM image". Not Shoal's to ship, so not held to the checks above.
PEER_IMAGES = {"images/vllm-cpu/Dockerfile"}


def all_dockerfiles() -> list[str]:
    found = {"Dockerfile", *(str(p.relative_to(REPO)) for p in REPO.glob("images/**/Dockerfile*"))}
    return sorted(f for f in found if not f.endswith(".dockerignore") and f not in PEER_IMAGES)


def test_every_dockerfile_in_the_repository_is_checked():
    assert all_dockerfiles() == sorted(DOCKERFILES), (
        "add each Dockerfile and its targets to DOCKERFILES so it is checked"
    )


def targets():
    return [(f, t) for f, ts in DOCKERFILES.items() for t in ts]


def _target(path: str, name: str) -> tuple[Dockerfile, Stage]:
    df = parse(REPO / path)
    stage = df.stage(name)
    assert stage is not None, f"{path}: no stage named {name!r} (docker build --target {name})"
    return df, stage


@pytest.mark.parametrize("path,name", targets())
def test_target_runs_as_a_non_root_user(path, name):
    df, stage = _target(path, name)
    user = df.inherited(stage, "USER")
    assert user is not None, f"{path} --target {name}: no USER, so it runs as root"
    uid = user.value.split(":")[0]
    assert uid not in ("root", "0"), f"{path}:{user.line}: USER {user.value} is root"
    # Numeric, so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
    assert uid.isdigit() and int(uid) >= 1000, f"{path}:{user.line}: USER should be a numeric uid"


@pytest.mark.parametrize("path,name", targets())
def test_target_runs_its_command_under_tini(path, name):
    df, stage = _target(path, name)
    entry = df.inherited(stage, "ENTRYPOINT")
    assert entry is not None, f"{path} --target {name}: no ENTRYPOINT"
    assert entry.value.lstrip().startswith("["), (
        f"{path}:{entry.line}: ENTRYPOINT must be exec form, or a shell is PID 1 and eats signals"
    )
    argv = entry.args()
    assert argv[0] in ("tini", "/usr/bin/tini", "/sbin/tini"), (
        f"{path}:{entry.line}: PID 1 is {argv[0]}"
    )
    assert "--" in argv and argv[argv.index("--") + 1] in ("shoal", "shoal-operator")
    assert "-g" in argv, "tini -g: SIGTERM must reach the engine's whole process group"
    # tini itself must be installed in the stage chain.
    installs = " ".join(i.value for s in df.chain(stage) for i in s.instructions
                        if i.keyword == "RUN")
    assert re.search(r"install\b.*\btini\b", installs), f"{path}: tini is never installed"


@pytest.mark.parametrize("path,name", targets())
def test_target_has_an_exec_form_healthcheck(path, name):
    df, stage = _target(path, name)
    hc = df.inherited(stage, "HEALTHCHECK")
    assert hc is not None and "CMD" in hc.value, f"{path} --target {name}: no HEALTHCHECK"
    script = hc.value.split("CMD", 1)[1].strip()
    assert script.startswith("["), "HEALTHCHECK CMD in exec form"


@pytest.mark.parametrize("path", sorted(DOCKERFILES))
def test_every_copy_source_exists_in_the_build_context(path):
    df = parse(REPO / path)
    excluded = dockerignore(REPO / ".dockerignore")
    names = {s.name for s in df.stages if s.name}
    problems = []
    for stage in df.stages:
        for ins in stage.instructions:
            if ins.keyword not in ("COPY", "ADD"):
                continue
            flags, args = ins.flags(), ins.args()
            if "from" in flags:
                src = flags["from"]
                earlier = {s.name for s in df.stages[: stage.index] if s.name}
                if src in names and src not in earlier:
                    problems.append(f"line {ins.line}: COPY --from={src} before that stage")
                elif src not in names and not (src.isdigit() and int(src) < stage.index):
                    problems.append(f"line {ins.line}: COPY --from={src}: no such stage")
                continue
            for source in args[:-1]:
                matches = glob.glob(source.rstrip("/"), root_dir=REPO)
                if not matches:
                    problems.append(f"line {ins.line}: {source} does not exist")
                for m in matches:
                    if excluded(m):
                        problems.append(f"line {ins.line}: {m} is excluded by .dockerignore")
    assert not problems, f"{path}:\n" + "\n".join(problems)


@pytest.mark.parametrize("path", sorted(DOCKERFILES))
def test_base_images_are_pinned(path):
    df = parse(REPO / path)
    names = {s.name for s in df.stages if s.name}
    for stage in df.stages:
        if stage.base in names:
            continue
        assert "$" not in stage.base, f"{path}:{stage.line}: unresolved {stage.base}"
        if "@sha256:" in stage.base:
            continue
        tag = stage.base.rsplit("/", 1)[-1].partition(":")[2]
        assert tag and tag != "latest" and re.search(r"\d+\.\d+", tag), (
            f"{path}:{stage.line}: base image {stage.base} is not pinned to an exact version"
        )


@pytest.mark.parametrize("target", ["operator", "router"])
def test_the_slim_images_install_no_torch(target):
    df, stage = _target("Dockerfile", target)
    for s in df.depends_on(stage):
        for ins in s.instructions:
            if ins.keyword == "RUN":
                assert not any(t in ins.value for t in ("torch==", "[engine]", "[all]")), (
                    f"Dockerfile:{ins.line}: stage {s.name} feeds the {target} image but "
                    "installs torch")
    assert any(f"[{target}]" in i.value for s in df.depends_on(stage) for i in s.instructions)


def test_the_engine_image_pins_torch():
    for path in DOCKERFILES:
        df = parse(REPO / path)
        runs = " ".join(i.value for s in df.depends_on(df.stage("engine")) for i in s.instructions)
        assert "torch==${TORCH_VERSION}" in runs and df.global_args.get("TORCH_VERSION") == "2.13.0"


def test_reader_sees_a_root_user_and_a_missing_copy_source(tmp_path):
    """The checks above can fail: a Dockerfile that runs as root and copies a missing file."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:3.11.7-slim AS app\nCOPY no-such-file /x\nUSER root\n"
                   "ENTRYPOINT shoal\n")
    df = parse(bad)
    app = df.stage("app")
    assert df.inherited(app, "USER").value == "root"
    assert not df.inherited(app, "ENTRYPOINT").value.startswith("[")
    assert not glob.glob("no-such-file", root_dir=REPO)
    excluded = dockerignore(REPO / ".dockerignore")
    assert excluded("tests/conftest.py") and excluded("engine/shoal/engine/__pycache__/x.pyc")
    assert not excluded("cli/shoal/cli/__init__.py") and not excluded("pyproject.toml")


def _healthcheck() -> dict:
    """The image's standalone script (not a package module), run as the image runs it."""
    return runpy.run_path(str(REPO / "images" / "healthcheck.py"))


@pytest.mark.parametrize(
    "argv,url",
    [
        (["tini", "-g", "--", "shoal", "serve", "/m", "--port", "9000"], "http://127.0.0.1:9000/health"),
        (["tini", "-g", "--", "shoal", "serve", "/m"], "http://127.0.0.1:8000/health"),
        (["tini", "-g", "--", "shoal", "serve", "/m", "--headless", "--node-rank", "1"], None),
        (["tini", "-g", "--", "shoal-operator", "--liveness=http://0.0.0.0:8080/healthz"],
         "http://127.0.0.1:8080/healthz"),
        (["tini", "-g", "--", "shoal-operator", "--all-namespaces"], None),
        (["tini", "-g", "--", "shoal", "router", "--engine-discovery-file", "/d"],
         "http://127.0.0.1:8000/health"),
        (["tini", "-g", "--", "shoal", "gateway", "--port", "8001"], "http://127.0.0.1:8001/health"),
        (["tini", "-g", "--", "shoal", "make-model", "/m"], None),
    ],
)
def test_healthcheck_probes_only_what_the_command_serves(argv, url):
    assert _healthcheck()["probe_url"](argv) == url
