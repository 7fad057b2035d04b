"""`shoal fetch` as the init container runs it, against the stand-in hub as a real process: the
real huggingface_hub client and cache, downloads counted by the hub, failures read back from the
termination message the operator reads."""

from __future__ import annotations

import shutil
import time

import pytest
from huggingface_hub import scan_cache_dir
from shoal.contract.model_fetch import parse_progress
from shoal.contract.termination import Cause
from support.wait import wait_for

from .conftest import REPO_ID, Hub, fetch_env, finished, run_fetch, start_fetch

pytestmark = pytest.mark.process

URI = f"hf://{REPO_ID}"


def model_files(hub_root) -> dict[str, bytes]:
    base = hub_root / REPO_ID
    return {p.name: p.read_bytes() for p in base.iterdir() if not p.name.startswith(".")}


@pytest.mark.parametrize("cdn", [True, False], ids=["lfs-via-cdn-redirect", "lfs-direct"])
def test_fetch_fills_a_valid_cache_once(hub_root, tmp_path, cdn) -> None:
    hub = Hub(hub_root, tmp_path / "hub.log", cdn=cdn)
    try:
        cache = tmp_path / "cache"
        got = run_fetch(URI, cache, hub.url, tmp_path)
        assert got.rc == 0, got.out + got.err
        assert got.termination is None
        files = model_files(hub_root)
        assert hub.downloads() == {f"{REPO_ID}/{name}": 1 for name in files}
        # huggingface_hub's own reading of the cache: one repo, one revision, refs/main on it.
        [repo] = scan_cache_dir(cache).repos
        assert repo.repo_id == REPO_ID and repo.repo_type == "model"
        [rev] = repo.revisions
        assert rev.refs == frozenset({"main"})
        assert {f.file_name: f.file_path.read_bytes() for f in rev.files} == files
        assert f"start (commit {rev.commit_hash[:12]}" in got.out
        assert "done in" in got.out and "GiB/s" in got.out
        last = parse_progress(got.out)
        assert last is not None and last.repo == f"{REPO_ID}@main"
        assert last.done_gib == last.total_gib > 0

        again = run_fetch(URI, cache, hub.url, tmp_path)
        assert again.rc == 0 and "cached" in again.out, again.out + again.err
        pinned = run_fetch(f"{URI}@{rev.commit_hash}", cache, hub.url, tmp_path)
        assert pinned.rc == 0 and "cached" in pinned.out, pinned.out + pinned.err
        assert hub.downloads() == {f"{REPO_ID}/{name}": 1 for name in files}
    finally:
        hub.kill()


def test_a_tokenizer_fetch_takes_no_weights_and_the_router_tokenizes_from_it(hub_root,
                                                                              tmp_path) -> None:
    """`--files tokenizer` (a kv-aware frontend's init container): no weights; the router finds
    the snapshot by the fetcher's refs and tokenizes as the engine's tokenizer does; an engine
    fetch into the same cache is not fooled into taking it for a whole model."""
    from shoal.contract.model_fetch import cached_snapshot, parse_hf
    from shoal.router.kv_score import load_encoder
    from transformers import AutoTokenizer

    hub = Hub(hub_root, tmp_path / "hub.log")
    try:
        cache = tmp_path / "cache"
        got = run_fetch(URI, cache, hub.url, tmp_path, extra=("--files", "tokenizer"))
        assert got.rc == 0, got.out + got.err
        files = model_files(hub_root)
        taken = {n for n in files if not n.endswith(".safetensors")}
        assert hub.downloads() == {f"{REPO_ID}/{name}": 1 for name in taken}
        snapshot = cached_snapshot(str(cache), parse_hf(URI))
        text = "The billing team answers questions about invoices. " * 4
        ids = load_encoder(snapshot).encode(text)
        assert ids == AutoTokenizer.from_pretrained(snapshot)(text)["input_ids"]

        whole = run_fetch(URI, cache, hub.url, tmp_path)
        assert whole.rc == 0, whole.out + whole.err
        assert hub.downloads()[f"{REPO_ID}/model.safetensors"] == 1
    finally:
        hub.kill()


def test_concurrent_fetches_into_one_cache_download_each_file_once(hub_root, tmp_path) -> None:
    # Slowed to ~6 s a download, so the others start while the first holds the lock.
    hub = Hub(hub_root, tmp_path / "hub.log", "--throttle", "5000000")
    try:
        cache = tmp_path / "cache"
        envs = [fetch_env(hub.url, tmp_path) for _ in range(4)]
        procs = [start_fetch(URI, cache, env) for env in envs]
        results = [finished(p, env, timeout=180) for p, env in zip(procs, envs, strict=True)]
        assert [r.rc for r in results] == [0] * 4, [r.out + r.err for r in results]
        assert hub.downloads() == {f"{REPO_ID}/{n}": 1 for n in model_files(hub_root)}
        outs = [r.out for r in results]
        assert sum("done in" in o for o in outs) == 1, outs
        assert sum("cached" in o for o in outs) == 3, outs
        assert any("waiting for another fetch" in o for o in outs), outs
        # the fetches that waited trusted the first one's check: model_info + the tree listing,
        # once, plus one model_info for each fetch that found the lock free after the first
        waited = sum("waiting for another fetch" in o for o in outs)
        assert hub.stats()["api_calls"] == {REPO_ID: 2 + (3 - waited)}
        # progress while the slow download ran: lines below the total, then the total
        [downloader] = [o for o in outs if "done in" in o]
        lines = [parse_progress(line) for line in downloader.splitlines()]
        lines = [p for p in lines if p is not None]
        assert lines[-1].done_gib == lines[-1].total_gib
        assert any(p.done_gib < p.total_gib for p in lines), downloader
        # and the ones waiting showed the same download meanwhile (each pod's status has it)
        waiter_lines = [parse_progress(o) for o in outs if "waiting for another fetch" in o]
        assert any(p is not None and p.total_gib == lines[-1].total_gib for p in waiter_lines)
    finally:
        hub.kill()


@pytest.mark.parametrize(("token", "says"), [("wrong-token-42", "a token was given"),
                                             (None, "no token was given")])
def test_a_refused_token_is_permanent_and_names_the_repository(hub_root, tmp_path, token,
                                                                says) -> None:
    hub = Hub(hub_root, tmp_path / "hub.log", "--token", "right-token-7")
    try:
        got = run_fetch(URI, tmp_path / "cache", hub.url, tmp_path, token=token)
        assert got.rc == 2, got.out + got.err
        msg = got.termination
        assert msg is not None and msg.cause == Cause.MODEL_ACCESS_DENIED and msg.permanent
        assert REPO_ID in msg.message and says in msg.message, msg.message
        assert "wrong-token-42" not in got.out + got.err + msg.message
        assert hub.downloads() == {}

        ok = run_fetch(URI, tmp_path / "cache", hub.url, tmp_path, token="right-token-7")
        assert ok.rc == 0, ok.out + ok.err
    finally:
        hub.kill()


@pytest.mark.parametrize(("uri", "names"), [("hf://shoal/missing", "repository shoal/missing"),
                                            ("hf://shoal/tiny@v9", "revision 'v9' of shoal/tiny")])
def test_a_missing_model_is_permanent_and_named(hub, tmp_path, uri, names) -> None:
    got = run_fetch(uri, tmp_path / "cache", hub.url, tmp_path)
    assert got.rc == 2, got.out + got.err
    assert got.termination.cause == Cause.MODEL_NOT_FOUND
    assert names in got.termination.message and hub.url in got.termination.message


def _partial_bytes(blobs) -> int:
    """The largest partial blob's size; a small file may finish (and be renamed) between the
    listing and the stat, which CI saw."""
    sizes = [0]
    for p in blobs.glob("*.incomplete"):
        try:
            sizes.append(p.stat().st_size)
        except FileNotFoundError:
            pass
    return max(sizes)


def test_a_hub_that_stops_mid_download_is_transient_and_the_next_try_completes(
        hub_root, tmp_path) -> None:
    hub = Hub(hub_root, tmp_path / "hub.log", "--throttle", "2000000")  # ~14 s for the weights
    cache = tmp_path / "cache"
    env = fetch_env(hub.url, tmp_path)
    proc = start_fetch(URI, cache, env)
    try:
        blobs = cache / f"models--{REPO_ID.replace('/', '--')}" / "blobs"
        wait_for(lambda: _partial_bytes(blobs) > 1_000_000, 60,
                 interval=0.1, what="a partly downloaded weights blob")
        hub.kill()
        t0 = time.monotonic()
        got = finished(proc, env, timeout=120)
        took = time.monotonic() - t0
    finally:
        hub.kill()
    assert got.rc == 1, got.out + got.err
    assert got.termination.cause == Cause.DOWNLOAD_FAILED and not got.termination.permanent
    assert REPO_ID in got.termination.message
    assert took < 60, took  # the client retries a few times, then gives up
    assert not list(blobs.glob("*.incomplete"))  # huggingface_hub drops its partial files

    again = Hub(hub_root, tmp_path / "hub2.log", port=hub.port)
    try:
        retry = run_fetch(URI, cache, again.url, tmp_path)
        assert retry.rc == 0, retry.out + retry.err
        got_files = again.downloads()
        assert f"{REPO_ID}/model.safetensors" in got_files  # the interrupted file, again
    finally:
        again.kill()


def test_content_that_differs_from_the_metadata_is_deleted_and_transient(hub_root,
                                                                         tmp_path) -> None:
    """A mirror that serves other bytes than its metadata says (same size): huggingface_hub
    checks only the size, the fetcher checks the sha256."""
    root = tmp_path / "root"
    shutil.copytree(hub_root / REPO_ID, root / REPO_ID)
    hub = Hub(root, tmp_path / "hub.log")
    try:
        assert hub.stats()  # answering; the repository is read on the first model_info
        cache = tmp_path / "cache"
        first = run_fetch(URI, cache, hub.url, tmp_path)
        assert first.rc == 0
        shutil.rmtree(cache)
        weights = root / REPO_ID / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-1] ^= 0xFF
        weights.write_bytes(bytes(data))  # the stand-in still describes the old bytes
        got = run_fetch(URI, cache, hub.url, tmp_path)
    finally:
        hub.kill()
    assert got.rc == 1, got.out + got.err
    assert got.termination.cause == Cause.DOWNLOAD_FAILED
    assert "model.safetensors: sha256" in got.termination.message
    blobs = cache / f"models--{REPO_ID.replace('/', '--')}" / "blobs"
    assert len(list(blobs.iterdir())) == 5  # the bad weights blob is gone, the rest stay


def test_a_verified_snapshot_serves_while_the_hub_is_down(hub_root, tmp_path) -> None:
    hub = Hub(hub_root, tmp_path / "hub.log")
    cache = tmp_path / "cache"
    try:
        assert run_fetch(URI, cache, hub.url, tmp_path).rc == 0
    finally:
        hub.kill()
    got = run_fetch(URI, cache, hub.url, tmp_path)  # nothing listens there now
    assert got.rc == 0, got.out + got.err
    assert "cached" in got.out and "the hub is unreachable now" in got.out
    # a cache without that revision's verified snapshot has nothing to fall back on
    other = run_fetch(URI, tmp_path / "empty", hub.url, tmp_path)
    assert other.rc == 1 and other.termination.cause == Cause.DOWNLOAD_FAILED
