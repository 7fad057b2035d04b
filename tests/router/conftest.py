"""Fixtures for router tests: two real engine groups and one real frontend, shared per module
(starting `shoal serve` costs seconds on a 2-core machine)."""

from __future__ import annotations

import pytest
from router_helpers import API_KEY, RouterProcess, ServeProcess, write_discovery


@pytest.fixture(scope="module")
def engines(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engines")
    started = {g: ServeProcess(tiny_model, tmp, "--max-model-len", "2048", api_key=API_KEY)
               for g in (0, 1)}
    try:
        for e in started.values():
            e.wait_healthy()
        yield started
    finally:
        for e in started.values():
            e.stop()


@pytest.fixture(scope="module")
def discovery(engines, tmp_path_factory):
    path = tmp_path_factory.mktemp("discovery") / "engines.json"
    write_discovery(path, engines)
    return path


@pytest.fixture(scope="module")
def router(tiny_model, engines, discovery, tmp_path_factory):
    r = RouterProcess(tiny_model, discovery, tmp_path_factory.mktemp("router"))
    try:
        yield r.wait_listening()
    finally:
        rc = r.stop()
    assert rc == 0, f"the frontend exited with {rc} after SIGTERM:\n{r.log()[-2000:]}"
