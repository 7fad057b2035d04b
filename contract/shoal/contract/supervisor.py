"""The supervisor's contract: how the operator puts Shoal's supervisor in front of a stock vLLM.

A stock vLLM image (`runtime: VLLM`) writes no termination message, and its own exit says too
little (a killed EngineCore leaves the API server exiting 0). The operator therefore injects
`shoal.supervisor` into those engine pods without changing the image:

1. an init container from the Shoal router image (INIT_CONTAINER) copies BUNDLE_IN_IMAGE, a
   zipapp holding `shoal.supervisor` and the standard-library-only `shoal.contract`, into an
   emptyDir (VOLUME) mounted at MOUNT;
2. the engine container's command becomes `command(["vllm", "serve", ...])`: the vLLM image's
   own `python3` runs the bundle, which runs vLLM as its child, passes signals through, keeps
   the log unchanged, and writes the termination message (shoal.contract.termination) naming
   the process that died, its signal or exit code, and vLLM's root cause.

Everything here is ABI between the router image, the operator and the supervisor: append only.
"""

from __future__ import annotations

BUNDLE_NAME = "shoal-supervisor.pyz"
# Where the router image carries the bundle (built by the Dockerfile's router stage).
BUNDLE_IN_IMAGE = f"/opt/shoal-supervisor/{BUNDLE_NAME}"
INIT_CONTAINER = "install-supervisor"
VOLUME = "shoal-supervisor"
MOUNT = "/shoal-supervisor"
# The interpreter every vLLM image has on PATH (the bundle needs 3.9+, standard library only).
PYTHON = "python3"
# Separates the supervisor's own options from the command it runs.
SEPARATOR = "--"


def bundle_path() -> str:
    """The bundle inside the engine container (the shared volume)."""
    return f"{MOUNT}/{BUNDLE_NAME}"


def command(argv: list[str]) -> list[str]:
    """The engine container's command line: the supervisor, then vLLM's own."""
    return [PYTHON, bundle_path(), SEPARATOR, *argv]


def install_command() -> list[str]:
    """The init container's command: copy the bundle into the shared volume."""
    return ["cp", BUNDLE_IN_IMAGE, bundle_path()]
