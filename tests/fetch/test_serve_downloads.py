"""`shoal serve ORG/NAME` online downloads what its cache lacks, itself (no init container), with
the real huggingface_hub against the stand-in hub (the only hub reachable here), once: a second
server on the same --download-dir downloads nothing."""

from __future__ import annotations

import httpx
import pytest
from huggingface_hub import scan_cache_dir
from support.servers import ServeProcess

from .conftest import REPO_ID

pytestmark = pytest.mark.process


def _env(hub, tmp_path) -> dict:
    return {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_OFFLINE": "0"}


def test_serve_downloads_a_hub_id_into_download_dir_once(hub, hub_root, tmp_path) -> None:
    cache = tmp_path / "cache"
    engine_files = sorted(p.name for p in (hub_root / REPO_ID).iterdir()
                          if not p.name.startswith("."))
    for attempt in range(2):
        server = ServeProcess(REPO_ID, tmp_path, "--download-dir", str(cache),
                              env=_env(hub, tmp_path))
        try:
            server.wait_healthy()
            r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": "Hello", "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200, r.text
            assert f"model {REPO_ID}@main: {cache}/models--shoal--tiny/snapshots/" in server.log()
        finally:
            server.stop()
        # every engine file once, the first time only
        assert hub.downloads() == {f"{REPO_ID}/{n}": 1 for n in engine_files}, attempt
    [repo] = scan_cache_dir(cache).repos
    [rev] = repo.revisions
    assert repo.repo_id == REPO_ID and rev.refs == {"main"}
    assert {f.file_name for f in rev.files} == set(engine_files)


def test_serve_passes_hf_token_and_names_a_refused_one(hub_root, tmp_path) -> None:
    from shoal.contract.termination import Cause, parse_termination_message

    from .conftest import Hub

    hub = Hub(hub_root, tmp_path / "hub.log", "--token", "right-token-7")
    try:
        refused = ServeProcess(REPO_ID, tmp_path, "--download-dir", str(tmp_path / "cache"),
                               "--hf-token", "wrong-token-42", env=_env(hub, tmp_path))
        assert refused.wait_exit(120) == 2, refused.log()
        log = refused.log()
        refused.stop()
        msg = parse_termination_message(refused.termination_log.read_text())
        assert msg.cause == Cause.MODEL_ACCESS_DENIED, msg
        assert f"'{REPO_ID}'" in msg.message and "a token was given" in msg.message
        assert "wrong-token-42" not in msg.message + log
        assert hub.downloads() == {}
        ok = ServeProcess(REPO_ID, tmp_path, "--download-dir", str(tmp_path / "cache"),
                          "--hf-token", "right-token-7", env=_env(hub, tmp_path))
        try:
            ok.wait_healthy()
        finally:
            ok.stop()
        assert sum(hub.downloads().values()) > 0
    finally:
        hub.kill()
