"""The contract with vLLM's KV events, tested with the peer's real output: batches encoded by
vLLM 0.32's own classes (kv_vllm_events.py, run in the cached vLLM venv) are decoded by
kv_wire.py and, published on a real ZMQ PUB in this process with one sequence number dropped,
reach the router's subscriber, which asks the replay socket (vLLM's ROUTER protocol) for the
missing batch and ends with the complete index."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
from pathlib import Path

import pytest
import zmq
import zmq.asyncio
from shoal.router.discovery import Group
from shoal.router.kv_index import KvIndex
from shoal.router.kv_subscriber import Endpoints, KvSubscriber
from shoal.router.kv_wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
)
from support.vllm_cli import ensure_vllm_cli

pytestmark = pytest.mark.process

T = list(range(1000, 1016))  # four blocks of 4
U = list(range(2000, 2004))
V = list(range(3000, 3008))
H = [f"{i:02x}" * 32 for i in range(8)]  # vLLM's 32-byte sha256 block hashes, as hex
END = (-1).to_bytes(8, "big", signed=True)


def _stored(hashes, tokens, parent=None, **extra):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": 4, "lora_id": None, "medium": "GPU",
            "lora_name": None, **extra}


SCENARIOS = {
    "fields": [
        {"ts": 10.5, "events": [
            _stored([H[0], H[1]], T[:8]),
            _stored([7], U, parent=H[1], lora_name="adapter", extra_keys=[["adapter"]],
                    group_idx=0, medium="CPU"),
            {"type": "BlockRemoved", "block_hashes": [H[0], 7], "medium": "GPU"},
            {"type": "AllBlocksCleared"}]},
    ],
    "stream": [
        {"ts": 1.0, "events": [_stored([H[0], H[1]], T[:8])]},
        {"ts": 2.0, "events": [_stored([H[2]], T[8:12], parent=H[1])]},
        {"ts": 3.0, "events": [_stored([H[5]], U)]},
        # Dropped on the live stream: without the replay, U would still look cached.
        {"ts": 4.0, "events": [{"type": "BlockRemoved", "block_hashes": [H[5]],
                                "medium": "GPU"}]},
        {"ts": 5.0, "events": [_stored([H[3]], T[12:16], parent=H[2])]},
        {"ts": 6.0, "events": [_stored([41, 42], V)]},
    ],
}


@pytest.fixture(scope="module")
def vllm_frames(tmp_path_factory) -> dict[str, list[bytes]]:
    out = tmp_path_factory.mktemp("vllm-kv-events")
    script = Path(__file__).with_name("kv_vllm_events.py")
    proc = subprocess.run([str(ensure_vllm_cli().python), str(script), str(out)],
                          input=json.dumps(SCENARIOS), capture_output=True, text=True,
                          timeout=600, env={"VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1",
                                            "VLLM_LOGGING_LEVEL": "ERROR", "PATH": "/usr/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {name: [p.read_bytes() for p in sorted((out / name).glob("*.bin"))]
            for name in SCENARIOS}


def test_vllms_batches_decode_field_by_field(vllm_frames):
    (payload,) = vllm_frames["fields"]
    batch = decode_batch(payload)
    assert batch.ts == 10.5 and batch.data_parallel_rank == 0
    first, lora, removed, cleared = batch.events
    assert isinstance(first, BlockStored)
    assert first.block_hashes == [bytes.fromhex(H[0]), bytes.fromhex(H[1])]
    assert first.parent_block_hash is None and first.token_ids == T[:8]
    assert (first.block_size, first.medium, first.lora_name) == (4, "GPU", None)
    assert lora.block_hashes == [7] and lora.parent_block_hash == bytes.fromhex(H[1])
    assert (lora.lora_name, lora.medium, lora.group_idx) == ("adapter", "CPU", 0)
    assert lora.extra_keys == [("adapter",)]
    assert isinstance(removed, BlockRemoved)
    assert removed.block_hashes == [bytes.fromhex(H[0]), 7] and removed.medium == "GPU"
    assert isinstance(cleared, AllBlocksCleared)
    assert len(vllm_frames["stream"]) == len(SCENARIOS["stream"])


class Publisher:
    """A PUB and a replay ROUTER that answer as vLLM's ZmqEventPublisher does
    (_service_replay: (id, b"", topic, seq, payload) per buffered batch from the start, then
    (id, b"", b"", -1, b"")). Its buffer holds the batches up to the last one `send` was given
    (a batch skipped on the live stream was published and lost on the way: it is buffered)."""

    def __init__(self, ctx: zmq.asyncio.Context, payloads: list[bytes]) -> None:
        self.payloads = payloads
        self.pub = ctx.socket(zmq.PUB)
        self.pub.bind("tcp://127.0.0.1:*")
        self.router = ctx.socket(zmq.ROUTER)
        self.router.bind("tcp://127.0.0.1:*")
        self.endpoints = Endpoints(self.pub.getsockopt_string(zmq.LAST_ENDPOINT),
                                   self.router.getsockopt_string(zmq.LAST_ENDPOINT))
        self.replay_requests: list[int] = []
        self.published = 0

    async def send(self, seq: int) -> None:
        self.published = max(self.published, seq + 1)
        await self.pub.send_multipart((b"", seq.to_bytes(8, "big"), self.payloads[seq]))

    async def serve_replay(self) -> None:
        while True:
            client, empty, start = await self.router.recv_multipart()
            start = int.from_bytes(start, "big")
            self.replay_requests.append(start)
            for seq in range(start, self.published):
                await self.router.send_multipart(
                    (client, b"", b"", seq.to_bytes(8, "big"), self.payloads[seq]))
            await self.router.send_multipart((client, b"", b"", END, b""))

    def close(self) -> None:
        self.pub.close(linger=0)
        self.router.close(linger=0)


async def _until(check, what: str, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def _stop(ctx, publisher: Publisher, *tasks) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    publisher.close()
    ctx.destroy(linger=0)


async def _following(index: KvIndex, endpoints: Endpoints):
    sub = KvSubscriber(index, lambda g: endpoints)
    sub.set_groups([Group(0, "http://127.0.0.1:1")])
    return sub, asyncio.ensure_future(sub.run())


async def test_a_dropped_batch_is_replayed_and_the_index_is_complete(vllm_frames, caplog):
    caplog.set_level(logging.INFO, "shoal.router.kv")
    ctx = zmq.asyncio.Context()
    payloads = vllm_frames["stream"]
    publisher = Publisher(ctx, payloads)
    replay = asyncio.ensure_future(publisher.serve_replay())
    index = KvIndex()
    sub, running = await _following(index, publisher.endpoints)
    key = ("", 0)
    try:
        await _until(lambda: publisher.replay_requests == [0], "the subscription's first ask")
        # ZMQ's slow joiner: repeat batch 0 until the subscription has it (repeats are
        # duplicates, skipped by sequence number).
        async def first():
            while index.stats(0).blocks == 0:
                await publisher.send(0)
                await asyncio.sleep(0.05)
        await asyncio.wait_for(first(), 10)
        for seq in (1, 2, 4, 5):  # 3 is dropped
            await publisher.send(seq)
        await _until(lambda: index.longest_prefix(V) == {key: 8}, "the last batch")
        assert publisher.replay_requests == [0, 3]  # everything kept, at start; then the gap
        assert index.longest_prefix(T + [1]) == {key: 16}
        assert index.longest_prefix(U) == {}  # the replayed removal was applied, in order
        st = index.stats(0)
        assert (st.gaps, st.unrepaired_gaps, sub.replays, sub.decode_errors) == (1, 0, 2, 0)
        assert "KV events 3..3 missed; replaying" in caplog.text
    finally:
        await _stop(ctx, publisher, running, replay)


async def test_without_a_replay_the_group_is_cleared_not_trusted(vllm_frames, caplog):
    caplog.set_level(logging.INFO, "shoal.router.kv")
    ctx = zmq.asyncio.Context()
    payloads = vllm_frames["stream"]
    publisher = Publisher(ctx, payloads)
    index = KvIndex()
    endpoints = Endpoints(publisher.endpoints.events, None)
    sub, running = await _following(index, endpoints)
    key = ("", 0)
    try:
        async def first():
            while index.stats(0).blocks == 0:
                await publisher.send(0)
                await asyncio.sleep(0.05)
        await asyncio.wait_for(first(), 10)
        for seq in (1, 2, 4, 5):
            await publisher.send(seq)
        await _until(lambda: index.longest_prefix(V) == {key: 8}, "the last batch")
        # Batch 3 may have removed anything before it: all of it went; 4's parent is unknown.
        assert index.longest_prefix(T) == {} and index.longest_prefix(U) == {}
        st = index.stats(0)
        assert (st.gaps, st.unrepaired_gaps, st.orphans) == (1, 1, 1)
        assert "no replay endpoint: clearing" in caplog.text
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        publisher.close()
        ctx.destroy(linger=0)


def test_a_silent_group_with_traffic_is_reported_stale_once(caplog):
    caplog.set_level(logging.INFO, "shoal.router.kv")
    now = [0.0]
    index = KvIndex(stale_after=5.0)
    sub = KvSubscriber(index, lambda g: Endpoints("tcp://127.0.0.1:9", None),
                       clock=lambda: now[0])
    sub.set_groups([Group(0, "http://127.0.0.1:1")])  # no loop running: remembered only
    index.note_traffic(("", 0), 0.0)
    for t in (1.0, 6.0, 7.0):
        now[0] = t
        sub.tick()
    assert caplog.text.count("stopped (no batch for 6 s while it had traffic)") == 1
    assert "KV events of group 0 stopped" in caplog.text
    index.apply(("", 0), 0, KVEventBatch(1.0, []), 8.0)
    sub.tick()
    assert "KV events of group 0 resumed" in caplog.text
    sub.ctx.destroy(linger=0)


async def test_a_publisher_that_goes_away_makes_its_group_stale_until_it_is_back(vllm_frames,
                                                                                 caplog):
    caplog.set_level(logging.INFO, "shoal.router.kv")
    ctx = zmq.asyncio.Context()
    publisher = Publisher(ctx, vllm_frames["stream"])
    index = KvIndex(disconnected_after=0.5)
    sub, running = await _following(index, publisher.endpoints)
    key = ("", 0)
    try:
        await _until(lambda: index.why_stale(key, sub.clock()) is None
                     and index._groups[key].down_since is None, "the connection")
        publisher.pub.close(linger=0)  # the engine went away
        await _until(lambda: key in index.stale, "the group to go stale")
        assert "KV events of group 0 stopped (no connection to its publisher" in caplog.text
        back = ctx.socket(zmq.PUB)
        back.bind(publisher.endpoints.events)
        await _until(lambda: key not in index.stale, "the group to recover")
        assert "KV events of group 0 resumed" in caplog.text
        back.close(linger=0)
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        publisher.close()
        ctx.destroy(linger=0)


async def test_a_new_subscription_learns_an_idle_groups_cache_without_waiting_for_an_event(
        vllm_frames, caplog):
    """A router (re)started while a group is idle: the group's blocks come from its replay at
    once, not with its next batch (kv_routing.py --router-restart: the first 2 s after a
    restart were all misses at 4 req/s)."""
    caplog.set_level(logging.INFO, "shoal.router.kv")
    ctx = zmq.asyncio.Context()
    publisher = Publisher(ctx, vllm_frames["stream"])
    publisher.published = 3  # batches 0-2 published before this router existed; none since
    replay = asyncio.ensure_future(publisher.serve_replay())
    index = KvIndex()
    sub, running = await _following(index, publisher.endpoints)
    key = ("", 0)
    try:
        await _until(lambda: index.longest_prefix(T + [1]) == {key: 12}, "the replayed cache")
        assert index.longest_prefix(U) == {key: 4}
        assert publisher.replay_requests == [0] and index.last_seq(key) == 2
        assert "asking" in caplog.text and "for the KV events it keeps" in caplog.text
        await publisher.send(3)  # the live stream goes on from there, in order
        await _until(lambda: index.last_seq(key) == 3, "the next live batch")
        assert index.stats(0).gaps == 0 and publisher.replay_requests == [0]
    finally:
        await _stop(ctx, publisher, running, replay)
