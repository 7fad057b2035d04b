"""What the fetch init container leaves is what the engine container serves: `shoal fetch` into
CACHE/hub, then `shoal serve ORG/NAME --revision main --download-dir CACHE/hub` offline (the
command the operator renders for an hf:// model)."""

from __future__ import annotations

import httpx
import pytest
from shoal.engine.entrypoints import vllm_flags
from support.servers import ServeProcess

from .conftest import REPO_ID, run_fetch

pytestmark = [
    pytest.mark.process,
    pytest.mark.skipif(
        vllm_flags.table()["--download-dir"].kind == vllm_flags.NO_EFFECT,
        reason="shoal serve does not resolve a hub id from a Hugging Face cache yet "
               "(--download-dir is 'accepted, no effect' in vllm_flags; issue 23 part 3)"),
]


def test_serve_answers_from_the_fetched_cache_offline(hub, tmp_path) -> None:
    cache = tmp_path / "model-cache" / "hub"
    got = run_fetch(f"hf://{REPO_ID}", cache, hub.url, tmp_path)
    assert got.rc == 0, got.out + got.err
    hub.kill()  # offline from here on: nothing may reach a hub
    server = ServeProcess(REPO_ID, tmp_path, "--revision", "main", "--download-dir", str(cache),
                          env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home"),
                               "HF_ENDPOINT": "http://127.0.0.1:9"})
    try:
        server.wait_healthy()
        r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "The capital of France is", "max_tokens": 8,
            "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
    finally:
        server.stop()
