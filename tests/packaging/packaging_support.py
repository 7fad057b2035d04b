"""Paths and helpers shared by the packaging checks (imported by conftest and tests)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "shoal"
EXAMPLES = REPO / "examples"
DATA = Path(__file__).resolve().parent / "data"


def example_values_files() -> list[Path]:
    return sorted(EXAMPLES.glob("values-*.yaml"))


def example_engines() -> list[Path]:
    """Every example manifest holding an InferenceEngine."""
    return sorted(
        p
        for p in EXAMPLES.glob("*.yaml")
        if any(d and d.get("kind") == "InferenceEngine" for d in yaml.safe_load_all(p.read_text()))
    )


def load_all(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def run(cmd: list, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=120, **kw)


class HelmError(Exception):
    """`helm template` refused the values; str() is helm's message."""
