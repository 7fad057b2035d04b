"""Fixtures for the operator's integration tests: the CRD installed once, a real `shoal-operator`
process (kopf) watching the namespaces this module creates.

Namespaces: `opt-*` are watched by the shared operator; `opr-*` by the operator that the
restart test starts and stops itself; `opi-*` by nobody (in-process reconciler tests).
"""

from __future__ import annotations

import pytest
from kubernetes import client
from shoal.operator.kube import Kube
from support import crds
from support.builders import engine
from support.engine_api import cleanup_namespace, create_ie, pods
from support.operator_proc import OperatorProcess
from support.wait import WaitTimeout, wait_for


@pytest.fixture(scope="session")
def kube(control_plane) -> Kube:
    return Kube(control_plane.api_client())


@pytest.fixture(scope="session")
def core(kube) -> client.CoreV1Api:
    """The same connection as a typed client: what support.kubelet writes pod status with."""
    return client.CoreV1Api(kube.api)


@pytest.fixture(scope="session")
def crd_installed(kube) -> dict:
    """Install (or update) the generated CRDs and wait until the server serves them."""
    return crds.install(kube)


@pytest.fixture(scope="module")
def operator(control_plane, crd_installed, kube, tmp_path_factory):
    op = OperatorProcess(
        control_plane, "opt-*", tmp_path_factory.mktemp("operator") / "operator.log"
    ).start()
    # kopf answers its liveness probe before it follows namespaces that match its pattern; a
    # namespace created in that moment was seen to be missed (issue noted in docs/operator.md).
    # A first resource, created after the start, must get its pods before any test begins.
    # The warm-up namespace can itself fall in that moment (seen once in CI, 2026-12-01): a
    # namespace the operator missed stays missed, so the next try makes a new one.
    for attempt in range(3):
        warm = control_plane.new_namespace("opt")
        create_ie(kube, engine("warmup", warm).manifest())
        try:
            wait_for(lambda warm=warm: pods(kube, warm, "warmup"), timeout=30,
                     what="the operator to act in a new namespace")
            break
        except WaitTimeout:
            if attempt == 2:
                raise
        finally:
            cleanup_namespace(kube, warm)
    yield op
    alive = op.proc.poll() is None
    op.stop()
    assert alive, f"the operator died during the tests:\n{op.tail()}"


@pytest.fixture
def ns(control_plane, operator, kube, request):
    """A namespace the shared operator watches; the operator's log is printed on failure."""
    name = control_plane.new_namespace("opt")
    yield name
    if getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed:
        print(operator.tail())
    cleanup_namespace(kube, name)


@pytest.fixture
def quiet_ns(control_plane, crd_installed, kube):
    """A namespace no operator watches (in-process reconciler tests)."""
    name = control_plane.new_namespace("opi")
    yield name
    cleanup_namespace(kube, name)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)

