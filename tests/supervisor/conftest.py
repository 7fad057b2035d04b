"""The supervisor as production runs it: the zipapp, under a python with no site-packages."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def bundle(tmp_path_factory) -> Path:
    from shoal.supervisor import bundle as bundle_mod

    return bundle_mod.build(tmp_path_factory.mktemp("bundle") / "shoal-supervisor.pyz")


def supervisor_argv(bundle: Path, log: Path, *command: str, python: str = sys.executable
                    ) -> list[str]:
    """`-I -S`: no site-packages, no PYTHONPATH: only the standard library and the bundle."""
    return [python, "-I", "-S", str(bundle), "--termination-log", str(log), "--", *command]


def _start(bundle: Path, log: Path, *command: str, python: str = sys.executable,
           **kw) -> subprocess.Popen:
    log.write_text("")  # as in a pod: the file exists, empty
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.PIPE)
    return subprocess.Popen(supervisor_argv(bundle, log, *command, python=python), **kw)


@pytest.fixture
def start():
    """`start(bundle, log, *command, python=..., **popen)`: the supervisor running `command`."""
    return _start
