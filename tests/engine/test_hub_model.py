"""`shoal serve ORG/NAME`: a hub id resolved from a Hugging Face cache as vLLM does
(model_files.py), with the real huggingface_hub. The cache is the project's tiny model written
in the library's documented layout (support/hf_cache.py), which the real scan_cache_dir() reads
as a valid entry; no hub exists here, so the servers run offline (HF_HUB_OFFLINE=1) or against a
hub address nothing answers (the library then falls back to its cache, as it does for vLLM)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import httpx
import pytest
from huggingface_hub import scan_cache_dir
from shoal.contract.termination import Cause, parse_termination_message
from shoal.engine import model_files
from shoal.engine.model_files import ResolveError, is_hub_id, resolve
from support.hf_cache import write_snapshot
from support.net import free_port
from support.servers import KV_BYTES, ServerProcess

REPO = "shoal-test/tiny"
TOKENIZER_REPO = "shoal-test/tiny-tokenizer"
MAIN = "a" * 40
V2 = "b" * 40
TEMPLATE = "<<{{ messages[0]['content'] }}>>"


@pytest.fixture(scope="module")
def hub_cache(tiny_model, tmp_path_factory) -> Path:
    """HF_HOME/hub with REPO at main (the tiny model) and at v2 (context length 512), and
    TOKENIZER_REPO (the tiny tokenizer with another chat template) at v2 only."""
    home = tmp_path_factory.mktemp("hf-home")
    cache = home / "hub"
    write_snapshot(cache, REPO, Path(tiny_model), MAIN)
    other = tmp_path_factory.mktemp("v2")
    for f in Path(tiny_model).iterdir():
        shutil.copy(f, other / f.name)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 512}))
    write_snapshot(cache, REPO, other, V2, refs=("v2",))
    tok = tmp_path_factory.mktemp("tok")
    for name in ("tokenizer.json", "special_tokens_map.json", "tokenizer_config.json"):
        shutil.copy(Path(tiny_model) / name, tok / name)
    tcfg = json.loads((tok / "tokenizer_config.json").read_text())
    (tok / "tokenizer_config.json").write_text(json.dumps({**tcfg, "chat_template": TEMPLATE}))
    write_snapshot(cache, TOKENIZER_REPO, tok, V2, refs=("v2",))
    return cache


def test_the_cache_is_one_the_real_library_reads(hub_cache):
    info = scan_cache_dir(hub_cache)
    assert not info.warnings, info.warnings
    repos = {r.repo_id: r for r in info.repos}
    assert set(repos) == {REPO, TOKENIZER_REPO}
    revs = {r.commit_hash: r for r in repos[REPO].revisions}
    assert set(revs) == {MAIN, V2}
    assert revs[MAIN].refs == {"main"} and revs[V2].refs == {"v2"}
    assert {f.file_name for f in revs[MAIN].files} >= {"config.json", "model.safetensors",
                                                      "tokenizer.json"}


@pytest.mark.parametrize("name, hub", [
    ("Qwen/Qwen3-0.6B", True), ("gpt2", True), ("meta-llama/Llama-3.1-8B-Instruct", True),
    ("/models/tiny", False), ("./a/b/c", False), ("a/b/c", False), ("org/na--me", False),
])
def test_is_hub_id(name, hub):
    assert is_hub_id(name) is hub


@pytest.fixture
def offline(monkeypatch):
    """HF_HUB_OFFLINE=1 for the library already imported in this process (it reads the
    variable at import; servers get it in their environment)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


@pytest.mark.parametrize("revision, commit, max_len", [
    (None, MAIN, 2048), ("main", MAIN, 2048), ("v2", V2, 512), (V2, V2, 512)])
def test_resolve_offline_picks_the_revision(hub_cache, offline, revision, commit, max_len):
    found = resolve(REPO, revision=revision, download_dir=str(hub_cache))
    assert Path(found.path) == hub_cache / "models--shoal-test--tiny" / "snapshots" / commit
    assert json.loads((Path(found.path) / "config.json").read_text())[
        "max_position_embeddings"] == max_len
    assert "offline" in found.how and str(hub_cache) in found.how


def test_a_local_directory_is_taken_as_it_is(tiny_model):
    assert resolve(tiny_model, revision="v9").path == tiny_model


@pytest.mark.parametrize("name, revision", [("shoal-test/absent", "main"), (REPO, "v3")])
def test_not_in_the_cache_offline_is_permanent_and_named(hub_cache, offline, name, revision):
    with pytest.raises(ResolveError) as err:
        resolve(name, revision=revision, download_dir=str(hub_cache))
    assert (err.value.cause, err.value.exit_code) == (Cause.MODEL_NOT_FOUND, 2)
    for said in (repr(name), repr(revision), str(hub_cache), "HF_HUB_OFFLINE"):
        assert said in str(err.value)


def test_the_default_cache_is_hf_hub_cache(hub_cache, offline, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache))
    assert resolve(REPO).path.endswith(MAIN)


def test_engine_files_are_the_fetchers():
    from shoal.contract.model_fetch import ENGINE_FILES

    assert model_files.ENGINE_FILES is ENGINE_FILES


# ---- real servers ---------------------------------------------------------------------------

def _serve(tmp: Path, *args: str, env: dict) -> ServerProcess:
    port = free_port()
    proc = ServerProcess(
        [sys.executable, "-m", "shoal.cli", "serve", *args, "--host", "127.0.0.1", "--port",
         str(port), "--kv-cache-memory-bytes", KV_BYTES],
        tmp / f"serve-{port}.log",
        {**_clean_env(), "SHOAL_TERMINATION_LOG": str(tmp / f"termination-{port}"), **env}, None)
    proc.port = port
    proc.termination_log = tmp / f"termination-{port}"
    return proc


def _clean_env() -> dict:
    import os

    drop = ("HF_HUB_OFFLINE", "HF_HOME", "HF_HUB_CACHE", "HF_ENDPOINT", "HF_TOKEN")
    return {k: v for k, v in os.environ.items() if k not in drop}


@pytest.mark.process
def test_serve_a_hub_id_offline_from_hf_home(hub_cache, tmp_path):
    """The id as given is the served name; the device line says CPU here (auto)."""
    s = _serve(tmp_path, REPO, env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(hub_cache.parent)})
    try:
        s.wait_answering("/health", "shoal serve ORG/NAME to become healthy", 180)
        assert httpx.get(f"{s.url}/v1/models").json()["data"][0]["id"] == REPO
        r = httpx.post(f"{s.url}/v1/completions", timeout=60, json={
            "model": REPO, "prompt": "The capital of France is", "max_tokens": 4,
            "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        log = s.log()
        assert f"model {REPO}@main: {hub_cache}/models--shoal-test--tiny/snapshots/{MAIN}" in log
        assert "device: cpu (--device auto: " in log and "max_model_len 2048" in log
    finally:
        s.stop()


@pytest.mark.process
def test_serve_another_revision_and_tokenizer_from_download_dir_with_no_hub(hub_cache,
                                                                            tmp_path):
    """Not offline, but the hub does not answer: the library falls back to the cache named by
    --download-dir (HF_HOME points elsewhere); --revision v2 is the 512-token config, and
    --tokenizer another repo's tokenizer, whose chat template /tokenize applies."""
    s = _serve(tmp_path, REPO, "--revision", "v2", "--download-dir", str(hub_cache),
               "--tokenizer", TOKENIZER_REPO, "--served-model-name", "tiny",
               env={"HF_HOME": str(tmp_path / "empty-home"),
                    "HF_ENDPOINT": "http://127.0.0.1:9"})  # nothing listens on port 9 here
    try:
        s.wait_answering("/health", "shoal serve ORG/NAME --revision v2 to become healthy", 180)
        log = s.log()
        assert "max_model_len 512" in log, log
        assert f"tokenizer {TOKENIZER_REPO}@v2: " in log
        r = httpx.post(f"{s.url}/tokenize", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}],
            "add_generation_prompt": False})
        assert r.status_code == 200, r.text
        plain = httpx.post(f"{s.url}/tokenize", json={"model": "tiny", "prompt": "<<hi>>",
                                                       "add_special_tokens": False}).json()
        assert r.json()["tokens"] == plain["tokens"]  # the tokenizer repo's template
    finally:
        s.stop()


@pytest.mark.process
def test_a_missing_id_exits_2_naming_id_revision_and_cache(hub_cache, tmp_path):
    s = _serve(tmp_path, "shoal-test/absent", "--revision", "r1", "--download-dir",
               str(hub_cache), env={"HF_HUB_OFFLINE": "1"})
    assert s.proc.wait(120) == 2, s.log()
    s.stop()
    msg = parse_termination_message(s.termination_log.read_text())
    assert msg.cause == Cause.MODEL_NOT_FOUND
    for said in ("'shoal-test/absent'", "'r1'", str(hub_cache)):
        assert said in msg.message


def _http(cls, status: int):
    import httpx2

    request = httpx2.Request("GET", "https://hub.example/api/models/o/n/revision/main")
    return cls(f"HTTP {status}", response=httpx2.Response(status, request=request))


def _errors():
    from huggingface_hub import errors as e

    return [
        (_http(e.GatedRepoError, 401), False, Cause.MODEL_ACCESS_DENIED, 2, "access denied"),
        (_http(e.RepositoryNotFoundError, 401), False, Cause.MODEL_NOT_FOUND, 2, "is private"),
        (_http(e.RevisionNotFoundError, 404), False, Cause.MODEL_NOT_FOUND, 2, "no such revision"),
        (_http(e.HfHubHTTPError, 403), False, Cause.MODEL_ACCESS_DENIED, 2, "HTTP 403"),
        (_http(e.HfHubHTTPError, 503), False, Cause.DOWNLOAD_FAILED, 1, "downloading into"),
        (e.LocalEntryNotFoundError("gone"), True, Cause.MODEL_NOT_FOUND, 2, "HF_HUB_OFFLINE"),
        (e.LocalEntryNotFoundError("gone"), False, Cause.DOWNLOAD_FAILED, 1, "not be reached"),
        (e.IncompleteSnapshotError("2 missing", "/s"), True, Cause.MODEL_NOT_FOUND, 2,
         "is incomplete"),
        (OSError("No space left on device"), False, Cause.DOWNLOAD_FAILED, 1, "No space left"),
    ]


@pytest.mark.parametrize("case", range(9))
def test_classify_the_librarys_errors(case):
    exc, offline, cause, code, says = _errors()[case]
    err = model_files.classify(exc, "o/n", "main", "/cache", offline, None)
    assert (err.cause, err.exit_code) == (cause, code), err
    assert says in str(err) and "'o/n'" in str(err) and "'main'" in str(err)


def test_offline_llm_takes_a_hub_id_and_a_tokenizer_repo(hub_cache, offline):
    """LLM("ORG/NAME", revision=, tokenizer=, download_dir=) as vLLM's: resolved from the cache
    like `shoal serve`; the v2 snapshot's context length and the tokenizer repo's template."""
    from shoal.engine import LLM

    llm = LLM(REPO, revision="v2", tokenizer=TOKENIZER_REPO, download_dir=str(hub_cache),
              kv_cache_memory_bytes=64 << 20)
    try:
        assert llm.engine_core.max_model_len == 512
        prompt = llm.get_tokenizer().apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=False)
        assert prompt == "<<hi>>"
    finally:
        llm.shutdown()


def test_offline_llm_names_a_missing_hub_id(hub_cache, offline):
    from shoal.engine import LLM

    with pytest.raises(ResolveError, match=r"shoal-test/absent.*main") as err:
        LLM("shoal-test/absent", download_dir=str(hub_cache))
    assert str(hub_cache) in str(err.value)
