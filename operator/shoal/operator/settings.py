"""The operator's own settings (not any InferenceEngine's): read once at start, from its
environment (the chart's values) and from the API server's version, and handed to every pass
inside EngineSpec, so render stays a pure function of what it is given.

- SHOAL_FETCH_IMAGE: the Shoal router image of the operator's own init containers: the
  `model-fetch` one (hf://: `shoal fetch`) and `install-supervisor` (runtime VLLM: it copies the
  supervisor's bundle, shoal.contract.supervisor.BUNDLE_IN_IMAGE). Default: the release's router
  image, which ships both.
- SHOAL_OCI_MODE: how an oci:// model reaches the pod: `auto` (default) picks an image volume
  where the API server enables the ImageVolume feature by default (Kubernetes 1.35, beta),
  else an init container that copies the model out of the image; `copy` or `image-volume`
  force one (a 1.35 node whose container runtime has no image volumes needs `copy`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

FETCH_IMAGE_ENV = "SHOAL_FETCH_IMAGE"
OCI_MODE_ENV = "SHOAL_OCI_MODE"
OCI_MODES = ("auto", "copy", "image-volume")
# ImageVolume: alpha in 1.31, beta (off) in 1.33, beta and on by default in 1.35
# (https://kubernetes.io/docs/tasks/configure-pod-container/image-volumes).
IMAGE_VOLUME_DEFAULT_SINCE = (1, 35)


@dataclass(frozen=True)
class OperatorSettings:
    fetch_image: str = ""  # "" = the release's router image (render_common.shoal_init_image)
    image_volumes: bool = False  # oci:// as an image volume (else copied by an init container)


def server_version(info: dict | None) -> tuple[int, int] | None:
    """(major, minor) from the API server's /version ("1", "35+" as some providers write it)."""
    try:
        major = int(re.match(r"\d+", str(info["major"])).group())
        minor = int(re.match(r"\d+", str(info["minor"])).group())
    except (TypeError, KeyError, AttributeError, ValueError):
        return None
    return major, minor


def image_volumes(mode: str, version: tuple[int, int] | None) -> bool:
    """Whether oci:// models are image volumes: forced by `mode`, else on from
    IMAGE_VOLUME_DEFAULT_SINCE (an unknown version copies, which every server runs)."""
    if mode not in OCI_MODES:
        raise ValueError(f"{OCI_MODE_ENV}={mode!r}: one of {', '.join(OCI_MODES)}")
    if mode != "auto":
        return mode == "image-volume"
    return version is not None and version >= IMAGE_VOLUME_DEFAULT_SINCE


def from_env(version_info: dict | None, env=os.environ) -> OperatorSettings:
    mode = env.get(OCI_MODE_ENV) or "auto"
    return OperatorSettings(fetch_image=env.get(FETCH_IMAGE_ENV, ""),
                            image_volumes=image_volumes(mode, server_version(version_info)))
