"""Suite-wide fixtures and the four test tiers.

Fixtures shared by every area come from tests/support (importable as `support`, pytest's
`pythonpath`):
- support.models: the project's own small models, built once per cache (`tiny_model`,
  `small_model`).
- support.control_plane: a real kube-apiserver + etcd + controller-manager, built once per cache
  and started once per session (`control_plane`).

Tiers (each test gets exactly one marker; `make test-unit`, `test-process`, `test-k8s`,
`test-e2e` run one, `make test` runs all):
- `unit`: pure code, in this process: no server, no child process, no cluster.
- `process`: real processes and sockets on this machine (a `shoal serve`, engine ranks, a
  router); marked `pytestmark = pytest.mark.process` in the module.
- `k8s`: a real API server (uses the `control_plane` fixture).
- `e2e`: real pods on the local two-node cluster (uses the `cluster` fixture).
"""

from __future__ import annotations

pytest_plugins = ["support.models", "support.control_plane"]

TIERS = ("unit", "process", "k8s", "e2e")


def tier_of(item) -> str:
    """The tier a test needs: the highest of what its fixtures start and its marks."""
    fixtures = set(getattr(item, "fixturenames", ()))
    needed = {"e2e"} if "cluster" in fixtures else {"k8s"} if "control_plane" in fixtures else set()
    needed |= {m.name for m in item.iter_markers() if m.name in TIERS}
    return max(needed or {"unit"}, key=TIERS.index)


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        tier = tier_of(item)
        lower = {m.name for m in item.iter_markers() if m.name in TIERS} - {tier}
        if lower:
            # A module's `process` mark on a test that also needs an API server: it is a k8s test.
            raise ValueError(f"{item.nodeid}: marked {sorted(lower)} but needs the {tier} tier; "
                             "mark the test, not its module")
        item.add_marker(tier)
