"""The end-to-end tier: real pods on the local cluster's two nodes (tests/support/cluster.py)."""

from support.cluster import cluster, pytest_collection_finish, pytest_runtest_makereport  # noqa: F401
