"""The end-to-end tier: real pods on the local cluster's two nodes (tests/support/cluster.py)."""

import pytest
from support.cluster import cluster, pytest_collection_finish, pytest_runtest_makereport  # noqa: F401


@pytest.fixture
def new_ns(cluster):  # noqa: F811
    """Namespaces made by one test, deleted when it ends (its engines stop using the cores)."""
    made: list[str] = []

    def make(prefix: str) -> str:
        made.append(cluster.new_namespace(prefix))
        return made[-1]

    yield make
    for ns in made:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
from support.vllm_image import vllm_image  # noqa: E402, F401 - runtime: VLLM tests
