"""The zipapp: what it holds, that it is reproducible, and that a bare python runs it."""

from __future__ import annotations

import subprocess
import sys
import zipfile

import pytest
from shoal.contract import supervisor
from shoal.supervisor import bundle

pytestmark = pytest.mark.process


def test_it_holds_the_two_packages_and_builds_the_same_bytes_twice(tmp_path):
    first = bundle.build(tmp_path / "a" / supervisor.BUNDLE_NAME)
    second = bundle.build(tmp_path / "b" / supervisor.BUNDLE_NAME)
    assert first.read_bytes() == second.read_bytes()
    assert first.read_bytes().startswith(b"#!/usr/bin/env python3\n")
    names = set(zipfile.ZipFile(first).namelist())
    assert {"__main__.py", "shoal/__init__.py", "shoal/contract/termination.py",
            "shoal/contract/supervisor.py", "shoal/supervisor/supervise.py"} <= names
    assert not any(n.startswith(("shoal/engine", "shoal/operator", "shoal/router")) for n in names)


def test_a_python_with_nothing_installed_runs_it(tmp_path):
    pyz = bundle.build(tmp_path / supervisor.BUNDLE_NAME)
    bad = subprocess.run([sys.executable, "-I", "-S", str(pyz)], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "no '--' before the command" in bad.stderr
    log = tmp_path / "termination-log"
    ran = subprocess.run([sys.executable, "-I", "-S", str(pyz), "--termination-log", str(log),
                          "--", "true"], capture_output=True, text=True, timeout=60)
    assert ran.returncode == 1  # `true` exited 0 without being asked to: never 0
    assert '"cause": "unexpected_exit"' in log.read_text()
