"""A router that starts after the engine has run past its replay buffer still learns the whole
cache: a real `shoal serve` (buffer of 4 batches) answers the late subscriber's replay with a
snapshot, and the late index equals the one of a subscriber that saw every batch live, then
stays equal as new batches arrive."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest
from router_helpers import API_KEY, MODEL_NAME, ServeProcess
from shoal.router.discovery import Group
from shoal.router.kv_index import KvIndex
from shoal.router.kv_subscriber import Endpoints, KvSubscriber
from support.net import free_port

pytestmark = pytest.mark.process

BUFFER = 4
KEY = ("", 0)


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    ev, rp = free_port(), free_port()
    proc = ServeProcess(tiny_model, tmp_path_factory.mktemp("kv-snapshot"), "--max-model-len",
                        "2048", "--kv-events-config",
                        json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                    "endpoint": f"tcp://*:{ev}",
                                    "replay_endpoint": f"tcp://*:{rp}",
                                    "buffer_steps": BUFFER}), api_key=API_KEY)
    proc.wait_healthy()
    proc.endpoints = Endpoints(f"tcp://127.0.0.1:{ev}", f"tcp://127.0.0.1:{rp}")
    yield proc
    proc.stop()


def _follow(index: KvIndex, ep: Endpoints, url: str):
    sub = KvSubscriber(index, lambda g: ep)
    sub.set_groups([Group(0, url)])
    return asyncio.ensure_future(sub.run())


async def _complete(client: httpx.AsyncClient, url: str, prompt: str) -> None:
    r = await client.post(f"{url}/v1/completions", timeout=60,
                          headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1})
    assert r.status_code == 200, r.text


async def _settled(a: KvIndex, b: KvIndex, what: str, timeout: float = 10.0) -> None:
    """Until both indexes hold the same non-empty set of blocks."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not (a.router_hashes(KEY) and a.router_hashes(KEY) == b.router_hashes(KEY)):
        assert loop.time() < deadline, (what, len(a.router_hashes(KEY)),
                                        len(b.router_hashes(KEY)))
        await asyncio.sleep(0.05)


async def test_a_late_router_learns_the_whole_cache_from_the_replay_snapshot(engine, caplog):
    caplog.set_level(logging.INFO, "shoal.router.kv")
    early, late = KvIndex(), KvIndex()
    running = [_follow(early, engine.endpoints, engine.url)]
    try:
        await asyncio.sleep(0.5)  # connected before the first batch (else it replays from 0)
        async with httpx.AsyncClient() as client:
            for i in range(3 * BUFFER):  # several batches each: far past the buffer
                await _complete(client, engine.url,
                                f"Tenant {i} keeps its own long instructions here. " * 6)
            # The early index is complete when a late one built from nothing matches it.
            running.append(_follow(late, engine.endpoints, engine.url))
            await _complete(client, engine.url, "One more prompt, to make a batch. " * 6)
            await _settled(early, late, "the late index after its snapshot")
            assert late.snapshots == 1 and late.unrepaired_gaps == 0
            assert early.snapshots == 0 and early.gaps == 0
            assert len(early.router_hashes(KEY)) > 3 * BUFFER  # many blocks, few batches kept
            before = early.router_hashes(KEY)
            await _complete(client, engine.url, "A new tenant, stored after the snapshot. " * 6)
            await _settled(early, late, "both indexes after a live batch")
            assert early.router_hashes(KEY) > before
        assert "replay answered with a snapshot" in caplog.text
        assert "sending a snapshot of" in engine.log()
    finally:
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
