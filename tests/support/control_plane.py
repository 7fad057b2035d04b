"""The `control_plane` fixture: a real etcd + kube-apiserver + kube-controller-manager per session.

Why real: the operator is tested with kopf against an API server that validates CRD schemas,
serves watches, garbage-collects owned objects and runs the StatefulSet controller; a mock would
test the mock. See docs/control-plane.md.

Build: the binaries are built once per cache by build.sh (shoal.devcluster.build; first time
10-20 minutes). That build runs in `pytest_collection_finish`, before any test's timeout starts,
and only when a collected test uses `control_plane`. If it fails, every such test errors with the
build's last output lines; it never silently skips (set SHOAL_SKIP_K8S=1 to skip on purpose).

Start: once per session in a temporary directory; start-up includes waiting until the garbage
collector has actually collected a probe object, so tests can rely on GC from their first line.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from shoal.devcluster import build
from shoal.devcluster import control_plane as cpmod  # also tests/packaging/test_rbac_enforced
from shoal.devcluster.layout import cache_root
from shoal.devcluster.procs import DevClusterError
from support.wait import wait_for

_build_error: str | None = None
_build_done = False


class ControlPlaneHandle:
    """What tests get: addresses, credentials and a few helpers. Interface kept stable.

    kubeconfig (str path), server (https URL), token (bearer token), ca_file (str path),
    root (state dir; logs in root/logs), env() (os.environ + KUBECONFIG, for `kopf run`/kubectl),
    api_client() (a new kubernetes.client.ApiClient; close it or use it as a context manager),
    new_namespace(prefix) (creates a unique namespace and returns its name),
    started_s / gc_ready_s (start-up timings, seconds).
    """

    def __init__(self, cp) -> None:
        self._cp = cp
        self.kubeconfig = str(cp.kubeconfig)
        self.server = cp.server
        self.token = cp.token
        self.ca_file = str(cp.ca_file)
        self.root = cp.root
        self.started_s = cp.started_s
        self.gc_ready_s = 0.0

    def env(self) -> dict[str, str]:
        return self._cp.env()

    def api_client(self):
        from kubernetes import config

        return config.new_client_from_config(config_file=self.kubeconfig)

    def new_namespace(self, prefix: str = "test", labels: dict[str, str] | None = None) -> str:
        from kubernetes import client

        name = f"{prefix[:40].rstrip('-')}-{uuid.uuid4().hex[:8]}"
        with self.api_client() as api:
            client.CoreV1Api(api).create_namespace(
                {"metadata": {"name": name, "labels": {"shoal-test": "true", **(labels or {})}}}
            )
        return name

    def check_alive(self) -> None:
        """Raise naming the component that died (with its log tail)."""
        self._cp.check_alive()


def _uses_control_plane(items) -> bool:
    return any("control_plane" in getattr(item, "fixturenames", ()) for item in items)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build (or find cached) binaries before tests run, outside any per-test timeout."""
    global _build_error, _build_done
    if session.config.option.collectonly or os.environ.get("SHOAL_SKIP_K8S") == "1":
        return
    if not _uses_control_plane(session.items):
        return
    tr = session.config.pluginmanager.get_plugin("terminalreporter")
    if not build.control_plane_built() and tr is not None:
        tr.write_line(
            f"control plane: building kube-apiserver/kube-controller-manager "
            f"({build.BUILD_SCRIPT}; first build takes 10-20 minutes)"
        )
    t0 = time.monotonic()
    try:
        log = _build_log_path()
        build.ensure_built(log, progress=tr.write_line if tr is not None else None)
    except (DevClusterError, OSError, subprocess.SubprocessError) as exc:
        _build_error = (
            f"{type(exc).__name__}: {exc}" if not isinstance(exc, DevClusterError) else str(exc)
        )
        if tr is not None:
            tr.write_line("control plane: build failed; tests using control_plane will error")
    else:
        _build_done = True
        if tr is not None and time.monotonic() - t0 > 5:
            tr.write_line(f"control plane: built in {time.monotonic() - t0:.0f}s (log {log})")


def _build_log_path() -> Path:
    """The build's log next to the cache, or in /tmp if the cache cannot be created."""
    try:
        cache_root().mkdir(parents=True, exist_ok=True)
        return cache_root() / "k8s-build.log"
    except OSError:
        fd, path = tempfile.mkstemp(prefix="shoal-k8s-build-", suffix=".log")
        os.close(fd)
        return Path(path)


def _gc_probe(handle: ControlPlaneHandle, timeout: float) -> None:
    """Wait until the garbage collector deletes a child whose owner is gone (its informers and
    graph need ~30 s after the controller manager starts)."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    ns = handle.new_namespace("gc-probe")
    with handle.api_client() as api:
        core = client.CoreV1Api(api)
        owner = core.create_namespaced_config_map(ns, {"metadata": {"name": "owner"}})
        core.create_namespaced_config_map(
            ns,
            {
                "metadata": {
                    "name": "child",
                    "ownerReferences": [
                        {
                            "apiVersion": "v1",
                            "kind": "ConfigMap",
                            "name": "owner",
                            "uid": owner.metadata.uid,
                        }
                    ],
                }
            },
        )
        core.delete_namespaced_config_map("owner", ns)

        def child_gone() -> bool:
            handle.check_alive()
            try:
                core.read_namespaced_config_map("child", ns)
            except ApiException as exc:
                if exc.status == 404:
                    return True
                raise
            return False

        wait_for(
            child_gone,
            timeout=timeout,
            interval=0.5,
            what="the garbage collector to delete a probe ConfigMap whose owner was deleted",
        )
        core.delete_namespace(ns)


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory):
    """A running control plane for the whole session (see ControlPlaneHandle)."""
    if os.environ.get("SHOAL_SKIP_K8S") == "1":
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("SHOAL_SKIP_K8S=1 is not allowed when CI=true")
        pytest.skip("SHOAL_SKIP_K8S=1")
    if _build_error is not None:
        pytest.fail(f"control plane build failed:\n{_build_error}", pytrace=False)
    if not _build_done and not build.control_plane_built():
        # Collected without the hook (e.g. a plugin ordering quirk): build here instead.
        try:
            build.ensure_built(_build_log_path())
        except (DevClusterError, OSError, subprocess.SubprocessError) as exc:
            pytest.fail(f"control plane build failed:\n{exc}", pytrace=False)

    root = tmp_path_factory.mktemp("control-plane")
    cp = cpmod.ControlPlane(root)
    try:
        cp.start(timeout=180)
    except DevClusterError as exc:
        pytest.fail(f"control plane did not start: {exc}", pytrace=False)
    handle = ControlPlaneHandle(cp)
    try:
        t0 = time.monotonic()
        _gc_probe(handle, timeout=120)
        handle.gc_ready_s = time.monotonic() - t0
        yield handle
        handle.check_alive()  # a component that died mid-session fails the last test's teardown
    finally:
        cp.stop()
