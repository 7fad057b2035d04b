"""Fixtures for the packaging checks: real helm and kubectl, and a chart renderer."""

from __future__ import annotations

import pytest
import yaml
from packaging_support import CHART, HelmError, run
from support.k8s_tools import K8sTools, ensure_k8s_tools


@pytest.fixture(scope="session")
def k8s_tools() -> K8sTools:
    return ensure_k8s_tools()


@pytest.fixture(scope="session")
def helm_template(k8s_tools):
    """Render the chart (`helm template`) and return its objects; a failed render raises
    HelmError with helm's own message, so a test can assert on what helm said."""

    def render(*args: str, release: str = "shoal", namespace: str = "shoal-system") -> list[dict]:
        proc = run([k8s_tools.helm, "template", release, CHART, "--namespace", namespace, *args])
        if proc.returncode != 0:
            raise HelmError(proc.stderr.strip())
        return [d for d in yaml.safe_load_all(proc.stdout) if d]

    return render
