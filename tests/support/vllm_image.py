"""The `vllm_image` fixture: the stock vLLM image built here (images/vllm-cpu), in the running
cluster's nodes, for e2e tests of `spec.runtime: VLLM` engines.

The image is about 6 GB, so plain `prepare` does not build it: tests/support/cluster.py's
collection hook runs `python -m shoal.devcluster image vllm` (cached; cold ~15 minutes) only
when a collected test uses this fixture, before any per-test timeout starts. The fixture then
imports the archive into each node that lacks it and returns the tag, which the test names as
`spec.image` (imagePullPolicy IfNotPresent: no registry serves it). The tag reads as release
0.32.0 to the operator (shoal.operator.vllm_version).
"""

from __future__ import annotations

import pytest
from shoal.devcluster import vllm_image as image


@pytest.fixture(scope="package")
def vllm_image(cluster) -> str:
    """The vLLM image's tag, held by every node of the cluster."""
    image.ensure_vllm_image()
    return image.VLLM_TAG
