"""KV cache events inside the engine (core/kv_events.py, kv_event_publisher.py): what the block
pool and KV cache manager report, that nothing is built when events are off, the
--kv-events-config parsing, and the publisher's PUB and replay sockets. The engine's real events
against vLLM's own classes: test_kv_events_contract.py."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq
from shoal.engine import wire
from shoal.engine.core import kv_events
from shoal.engine.core.kv_cache_manager import KVCacheManager
from shoal.engine.core.kv_event_publisher import END_SEQ, ZmqEventPublisher, binds
from shoal.engine.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    wire_hash,
)
from shoal.engine.core.request import Request
from shoal.engine.entrypoints.serve_flags import build_parser
from shoal.engine.errors import ConfigError
from shoal.engine.kv_events_config import KVEventsConfig, parse_kv_events_config

BS = 4


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, wire.SamplingParams(max_tokens=4), 4)


def run_prefill(kv: KVCacheManager, r: Request) -> None:
    """Admit a request as the scheduler does: prefix hits, then slots for the rest."""
    hit, n = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - n, hit) is not None
    r.num_computed_tokens = r.num_tokens


def workload(kv: KVCacheManager) -> None:
    """Two prompts sharing a block, the second evicting the first's tail, then a reset."""
    a = req("a", list(range(100, 112)))  # 3 full blocks
    run_prefill(kv, a)
    kv.free(a)
    b = req("b", list(range(100, 104)) + list(range(200, 217)))  # shares block 0; 5 full
    run_prefill(kv, b)
    kv.free(b)
    assert kv.reset_prefix_cache()


def test_events_report_stored_chains_evictions_and_reset():
    kv = KVCacheManager(num_blocks=7, block_size=BS)  # 6 usable
    kv.pool.enable_events()
    workload(kv)
    events = kv.pool.take_events()
    stored = [e for e in events if isinstance(e, BlockStored)]
    a_hashes = [wire_hash(h) for h in req_hashes(list(range(100, 112)))]
    assert stored[0] == BlockStored(block_hashes=a_hashes, parent_block_hash=None,
                                    token_ids=list(range(100, 112)), block_size=BS, lora_id=None,
                                    medium="GPU", lora_name=None, group_idx=0)
    # b hits block 0 and stores its 4 new full blocks chained under it
    b_tokens = list(range(100, 104)) + list(range(200, 217))
    b_hashes = [wire_hash(h) for h in req_hashes(b_tokens)]
    assert stored[1].block_hashes == b_hashes[1:5] and stored[1].parent_block_hash == a_hashes[0]
    assert stored[1].token_ids == b_tokens[4:20]
    # b needed 5 blocks with 3 free: two of a's cached blocks were evicted, tail first
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert [h for e in removed for h in e.block_hashes] == [a_hashes[2], a_hashes[1]]
    assert isinstance(events[-1], AllBlocksCleared)
    assert [type(e).__name__ for e in events] == ["BlockStored", "BlockRemoved", "BlockStored",
                                                  "AllBlocksCleared"]
    assert kv.pool.take_events() == []


def req_hashes(tokens: list[int]) -> list[int]:
    r = req("h", tokens)
    KVCacheManager(num_blocks=2, block_size=BS)._update_hashes(r)
    return r.block_hashes


def test_a_block_another_holds_breaks_the_run_and_is_not_reported():
    kv = KVCacheManager(num_blocks=20, block_size=BS)
    kv.pool.enable_events()
    tokens = list(range(12))
    a, b = req("a", tokens), req("b", tokens)
    run_prefill(kv, a)
    assert kv.allocate_slots(b, b.num_tokens) is not None  # admitted without a's hits
    events = kv.pool.take_events()
    assert len(events) == 1 and len(events[0].block_hashes) == 3  # b's duplicates: nothing
    kv.free(a)
    kv.free(b)


def test_nothing_is_built_when_events_are_off(monkeypatch):
    built = []
    for name in ("block_stored", "block_removed", "AllBlocksCleared"):
        real = getattr(kv_events, name)
        monkeypatch.setattr(kv_events, name,
                            lambda *a, _real=real, _n=name, **k: built.append(_n) or _real(*a, **k))
    on = KVCacheManager(num_blocks=7, block_size=BS)
    on.pool.enable_events()
    workload(on)
    assert sorted(set(built)) == ["AllBlocksCleared", "block_removed", "block_stored"]  # counted
    built.clear()
    off = KVCacheManager(num_blocks=7, block_size=BS)
    workload(off)
    assert built == [] and off.pool.events is None


@pytest.mark.parametrize("value, want", [
    (None, None),
    ("{}", KVEventsConfig(publisher="null")),
    ('{"enable_kv_cache_events": true}', KVEventsConfig(True, "zmq")),
    ('{"enable_kv_cache_events": "yes", "publisher": "null"}', KVEventsConfig(True, "null")),
    ({"enable_kv_cache_events": True, "endpoint": "ipc:///tmp/x", "buffer_steps": "5",
      "hwm": 0, "topic": "kv", "replay_endpoint": "tcp://*:5558"},
     KVEventsConfig(True, "zmq", "ipc:///tmp/x", "tcp://*:5558", 5, 0, 100_000, "kv")),
    ('{"enable_kv_cache_events": false, "endpoint": "inproc://x"}',  # not used: not checked
     KVEventsConfig(False, "null", "inproc://x")),
])
def test_config_as_vllm_reads_it(value, want):
    got = parse_kv_events_config(value)
    assert got == want
    if got is not None:
        assert got.publishes == (got.enable_kv_cache_events and got.publisher == "zmq")


@pytest.mark.parametrize("value, message", [
    ('{"bogus": 1}', "unknown field(s) ['bogus']"),
    ('{"publisher": "kafka"}', "publisher must be 'zmq' or 'null'"),
    ('{"buffer_steps": "x"}', "buffer_steps must be an integer"),
    ('{"hwm": 1.5}', "hwm must be an integer"),
    ('{"max_queue_size": -1}', "max_queue_size must not be negative"),
    ('{"topic": null}', "topic must be a string"),
    ('{"enable_kv_cache_events": "maybe"}', "enable_kv_cache_events must be a boolean"),
    ('{"enable_kv_cache_events": true, "endpoint": "inproc://kv"}', "inproc://"),
    ('{"enable_kv_cache_events": true, "endpoint": "tcp://*:0"}', "tcp://*:0"),
    ('{"enable_kv_cache_events": true, "endpoint": "udp://x:1"}', "tcp:// or ipc://"),
    ('{"enable_kv_cache_events": true, "replay_endpoint": "tcp://*:5557"}', "must differ"),
    ("[1]", "must be a JSON object"),
    ("{", "must be a JSON object"),
])
def test_config_refusals_name_the_field(value, message):
    with pytest.raises(ConfigError, match="--kv-events-config") as err:
        parse_kv_events_config(value)
    assert message in str(err.value)


def test_the_flag_reaches_the_namespace_and_bad_values_exit_2(capsys):
    args = build_parser().parse_args(["m", "--kv-events-config",
                                      '{"enable_kv_cache_events": true}'])
    assert args.kv_events_config == KVEventsConfig(True, "zmq")
    assert build_parser().parse_args(["m"]).kv_events_config is None
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["m", "--kv-events-config", '{"publisher": "kafka"}'])
    assert exit_.value.code == 2
    assert "argument --kv-events-config: publisher must be" in capsys.readouterr().err


@pytest.mark.parametrize("endpoint, bound", [
    ("tcp://*:5557", True), ("tcp://[::]:5557", True), ("ipc:///tmp/kv", True),
    ("tcp://router:5557", False), ("tcp://127.0.0.1:5557", False)])
def test_endpoint_bound_or_connected_as_vllm(endpoint, bound):
    assert binds(endpoint) is bound


def _batch(n: int) -> KVEventBatch:
    return KVEventBatch(ts=time.time(), events=[kv_events.block_removed([n])])


def test_publisher_numbers_batches_and_replays_from_a_sequence(tmp_path):
    cfg = parse_kv_events_config({
        "enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/pub",
        "replay_endpoint": f"ipc://{tmp_path}/replay", "buffer_steps": 3, "topic": "kv"})
    pub = ZmqEventPublisher(cfg)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(cfg.endpoint)
    try:
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        received: list[tuple[bytes, int, KVEventBatch]] = []
        n = 0
        while not received:  # the slow joiner: publish until the subscription has arrived
            pub.publish(_batch(n))
            n += 1
            if sub.poll(50):
                topic, seq, payload = sub.recv_multipart()
                received.append((topic, int.from_bytes(seq, "big"), decoder.decode(payload)))
        for i in range(n, n + 4):
            pub.publish(_batch(i))
        while received[-1][1] < n + 3:
            assert sub.poll(2000), "published batches did not arrive"
            topic, seq, payload = sub.recv_multipart()
            received.append((topic, int.from_bytes(seq, "big"), decoder.decode(payload)))
        seqs = [s for _, s, _ in received]
        assert seqs == list(range(seqs[0], n + 4)) and {t for t, _, _ in received} == {b"kv"}
        assert all(b.events[0].block_hashes == [s] and b.data_parallel_rank == 0
                   for _, s, b in received)
        # replay: the buffer holds the last 3 batches; ask from one of them, and from the start
        # (before the buffer: one snapshot batch under the last number, kv_snapshot.py)
        req = ctx.socket(zmq.DEALER)
        req.connect(cfg.replay_endpoint)
        for start, want in ((n + 2, [n + 2, n + 3]), (n + 1, [n + 1, n + 2, n + 3]),
                            (0, [n + 3])):
            req.send_multipart([b"", (start).to_bytes(8, "big")])
            got = []
            while True:
                assert req.poll(2000), "no replay answer"
                _, topic, seq, payload = req.recv_multipart()
                if seq == END_SEQ:
                    assert topic == b"" and payload == b""
                    break
                got.append(int.from_bytes(seq, "big"))
                events = decoder.decode(payload).events
                if start >= n + 1:
                    assert events[0].block_hashes == [got[-1]]
                else:  # removals of blocks never stored: an empty cache
                    assert events == [kv_events.AllBlocksCleared()]
            assert got == want
        req.close(linger=0)
    finally:
        sub.close(linger=0)
        ctx.term()
        pub.shutdown()


def test_a_taken_endpoint_is_a_startup_error_naming_it(tmp_path):
    ctx = zmq.Context()
    taken = ctx.socket(zmq.ROUTER)
    port = taken.bind_to_random_port("tcp://*")
    cfg = parse_kv_events_config({"enable_kv_cache_events": True,
                                  "endpoint": f"ipc://{tmp_path}/pub",
                                  "replay_endpoint": f"tcp://*:{port}"})
    try:
        with pytest.raises(RuntimeError, match=rf"replay_endpoint 'tcp://\*:{port}': cannot bind"):
            ZmqEventPublisher(cfg)
    finally:
        taken.close(linger=0)
        ctx.term()


def _stored(hashes, parent, tokens, bs=2) -> kv_events.BlockStored:
    return kv_events.BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                                 block_size=bs, lora_id=None, medium="GPU", lora_name=None,
                                 group_idx=0)


@pytest.mark.parametrize(("batches", "want"), [
    # (hash, parent, tokens) in the order the snapshot must list them
    ([[_stored([1, 2], None, [10, 11, 12, 13])]], [(1, None, [10, 11]), (2, 1, [12, 13])]),
    ([[_stored([1, 2, 3], None, [1, 2, 3, 4, 5, 6])], [kv_events.block_removed([3])]],
     [(1, None, [1, 2]), (2, 1, [3, 4])]),
    # the parent evicted and stored again after its child: still listed first
    ([[_stored([1, 2], None, [1, 2, 3, 4])], [kv_events.block_removed([1])],
      [_stored([1], None, [1, 2])]], [(1, None, [1, 2]), (2, 1, [3, 4])]),
    # a child whose parent is gone stays (as the engine's cache holds it), naming its parent
    ([[_stored([1, 2], None, [1, 2, 3, 4])], [kv_events.block_removed([1])]], [(2, 1, [3, 4])]),
    ([[_stored([1], None, [1, 2])], [kv_events.AllBlocksCleared()],
      [_stored([5], None, [7, 8])]], [(5, None, [7, 8])]),
])
def test_the_snapshot_lists_what_the_events_left_parents_first(batches, want):
    from shoal.engine.core.kv_snapshot import CacheMirror

    mirror = CacheMirror()
    for i, events in enumerate(batches):
        mirror.apply(KVEventBatch(ts=float(i + 1), events=events))
    snap = mirror.snapshot()
    assert snap.ts == float(len(batches)) and snap.events[0] == kv_events.AllBlocksCleared()
    got = [(e.block_hashes[0], e.parent_block_hash, e.token_ids) for e in snap.events[1:]]
    assert got == want
