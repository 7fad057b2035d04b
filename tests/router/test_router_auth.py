"""API keys in front of the routers: the same keys and variables as `shoal serve` and vLLM
(shoal.contract.auth), so a vLLM manifest's VLLM_API_KEY never leaves a router open."""

from __future__ import annotations

import contextlib
import os

import pytest
from fastapi.responses import Response
from fastapi.testclient import TestClient
from shoal.contract.auth import KeyCheck, api_keys
from shoal.router import main as router_main
from shoal.router.app import Surface, common_app
from shoal.router.gateway import build_parser as gateway_parser


@pytest.mark.parametrize("flag,environ,keys", [
    (None, {}, []),
    (None, {"VLLM_API_KEY": "v"}, ["v"]),
    (None, {"SHOAL_API_KEY": "s", "VLLM_API_KEY": "v"}, ["s", "v"]),
    (["a", "b"], {"VLLM_API_KEY": "v"}, ["a", "b"]),  # the flag wins, as in vLLM
    (None, {"SHOAL_API_KEY": ""}, []),
])
def test_keys_come_from_the_flag_else_both_variables(flag, environ, keys):
    assert api_keys(flag, environ) == keys


@pytest.mark.parametrize("header,ok", [
    ("Bearer k1", True), ("bearer k2", True), ("Bearer k3", False), ("k1", False),
    ("Basic k1", False), (None, False), ("", False),
])
def test_a_header_is_accepted_for_any_key(header, ok):
    assert KeyCheck(["k1", "k2"]).accepts(header) is ok


def test_no_keys_accepts_everything():
    assert KeyCheck([]).accepts(None) and not KeyCheck([])


def _app(keys: list[str]) -> TestClient:
    async def forward(request, path, body):
        return Response(b'{"ok": true}', media_type="application/json")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield

    async def metrics() -> bytes:
        return b""

    surface = Surface(forward=forward, models=lambda: [], unready=lambda: None, metrics=metrics)
    return TestClient(common_app("test", lifespan, keys, surface))


def test_both_routers_refuse_a_request_without_one_of_the_keys(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    monkeypatch.delenv("SHOAL_API_KEY", raising=False)
    args = router_main.build_parser().parse_args(["--engine-discovery-file", "/x"])
    keys = api_keys(args.api_key, os.environ)
    assert keys == ["from-vllm"]
    client = _app(keys)
    body = {"model": "m", "prompt": "hi"}
    denied = client.post("/v1/completions", json=body)
    assert denied.status_code == 401 and denied.json()["error"]["type"] == "AuthenticationError"
    ok = client.post("/v1/completions", json=body, headers={"Authorization": "Bearer from-vllm"})
    assert ok.status_code == 200
    assert gateway_parser().parse_args(["--api-key", "a", "b"]).api_key == ["a", "b"]
