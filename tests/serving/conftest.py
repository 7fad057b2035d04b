"""Fixtures for serving tests; the server helpers live in tests/support/servers.py."""

from __future__ import annotations

import pytest
from support.servers import ServeProcess, healthy_server


@pytest.fixture
def serve_factory(tiny_model, tmp_path):
    started: list[ServeProcess] = []

    def start(*flags: str, env: dict | None = None, api_key: str | None = None) -> ServeProcess:
        s = ServeProcess(tiny_model, tmp_path, *flags, env=env, api_key=api_key)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    """One healthy `shoal serve` on the tiny model at the shipped settings, per module."""
    with healthy_server(tiny_model, tmp_path_factory) as s:
        yield s
