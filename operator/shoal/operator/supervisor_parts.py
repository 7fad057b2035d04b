"""Shoal's supervisor in a stock vLLM engine pod (`runtime: VLLM`), per
shoal.contract.supervisor: what it adds to the pod. Pure builders, table-tested
(tests/operator/test_op_supervisor_parts.py).

A stock vLLM image writes no termination message, and its exit says too little (a killed
EngineCore leaves the API server exiting 0). So, without changing the image, the operator adds:
- an init container (`install-supervisor`) from the Shoal router image, the one the
  `model-fetch` container runs (SHOAL_FETCH_IMAGE), that copies the supervisor's zipapp into
- an emptyDir (`shoal-supervisor`), mounted read-only in the engine container, whose command
  becomes `python3 /shoal-supervisor/shoal-supervisor.pyz -- vllm`: the image's own python3
  runs the supervisor, which runs `vllm serve ...` (the args, unchanged) as its child and writes
  the termination message naming the process that died.

The install runs first among the init containers: it takes a second, from an image the node
pulls once, and a router image without the bundle then fails the pod before a model download
or a model image pull, not after it. Shoal's own image (`runtime: Shoal`) gets none of this: its
engine writes its own message.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.contract import supervisor as sv
from shoal.contract.termination import DEFAULT_PATH as TERMINATION_MESSAGE_PATH
from shoal.operator.render_common import shoal_init_image
from shoal.operator.spec import EngineSpec, Runtime

# A `cp` of a file of some hundred KiB: far below the model-fetch container's needs.
INSTALL_RESOURCES = {"requests": {"cpu": "10m", "memory": "16Mi"},
                     "limits": {"memory": "64Mi"}}
# What a template may not name, and why (validation.py quotes it).
OWNED_INIT_CONTAINERS = {
    sv.INIT_CONTAINER: "it installs Shoal's supervisor, which runs vLLM and writes its "
                       "termination message (runtime: VLLM)",
}


@dataclass(frozen=True)
class SupervisorParts:
    """What the supervisor adds to one engine pod; empty for Shoal's own runtime."""

    command: list[str] | None = None  # the engine container's; None keeps the image's
    volumes: list[dict] = field(default_factory=list)
    init_containers: list[dict] = field(default_factory=list)
    mounts: list[dict] = field(default_factory=list)  # the engine container's


def supervised(spec: EngineSpec) -> bool:
    return spec.runtime is Runtime.VLLM


def install_container(spec: EngineSpec) -> dict:
    """`cp` of the bundle into the shared volume. No termination message of its own: with
    FallbackToLogsOnError a failed copy's message is cp's line (`cannot stat ...`)."""
    return {
        "name": sv.INIT_CONTAINER,
        "image": shoal_init_image(spec),
        "imagePullPolicy": spec.image_pull_policy,
        "command": sv.install_command(),
        "volumeMounts": [{"name": sv.VOLUME, "mountPath": sv.MOUNT}],
        "resources": INSTALL_RESOURCES,
        "terminationMessagePath": TERMINATION_MESSAGE_PATH,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def supervisor_parts(spec: EngineSpec) -> SupervisorParts:
    if not supervised(spec):
        return SupervisorParts()
    return SupervisorParts(
        command=sv.command(["vllm"]),
        volumes=[{"name": sv.VOLUME, "emptyDir": {}}],
        init_containers=[install_container(spec)],
        mounts=[{"name": sv.VOLUME, "mountPath": sv.MOUNT, "readOnly": True}],
    )
