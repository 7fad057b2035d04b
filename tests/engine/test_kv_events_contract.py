"""The contract with vLLM's KV event consumers: Shoal's real engine (the tiny model) publishes
with --kv-events-config on, a plain ZeroMQ SUB socket receives, and vLLM 0.32's OWN classes
(`msgspec.msgpack.Decoder(vllm.distributed.kv_events.KVEventBatch)`, in the cached vLLM
environment of tests/support/vllm_cli.py) decode every payload. What vLLM decoded must tell a
consumer the truth: stored blocks' token ids reassemble each prompt's full blocks along chained
parent hashes, evictions arrive as BlockRemoved (the index rebuilt from the events is the
engine's own at the end), a reset as AllBlocksCleared, the sequence numbers are consecutive, and
the replay socket returns the same batches from a given sequence number."""

from __future__ import annotations

import json
import subprocess
import time

import msgspec
import pytest
import zmq
from shoal.engine.config import EngineConfig
from shoal.engine.core.kv_event_publisher import END_SEQ
from shoal.engine.core.kv_events import wire_hash
from support.vllm_cli import ensure_vllm_cli

from .test_engine_core import request, run_to_completion

BS = 16

# Runs in vLLM's environment: decode each payload file with vLLM's KVEventBatch, print JSON.
DECODER = r"""
import json, sys
import msgspec
from vllm.distributed.kv_events import KVEventBatch
decoder = msgspec.msgpack.Decoder(KVEventBatch)
out = []
for path in sys.argv[1:]:
    batch = decoder.decode(open(path, "rb").read())
    out.append({"ts": batch.ts, "data_parallel_rank": batch.data_parallel_rank,
                "events": [{"type": type(e).__name__, **msgspec.structs.asdict(e)}
                           for e in batch.events]})
print(json.dumps(out))
"""


def decode_with_vllm(payloads: list[bytes], tmp_path) -> list[dict]:
    paths = []
    for i, payload in enumerate(payloads):
        paths.append(tmp_path / f"batch-{i}.msgpack")
        paths[-1].write_bytes(payload)
    script = tmp_path / "decode.py"
    script.write_text(DECODER)
    proc = subprocess.run([str(ensure_vllm_cli().python), str(script), *map(str, paths)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"vLLM's decoder failed: {proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def receive(sub, until_idle_s: float = 0.5) -> list[tuple[bytes, int, bytes]]:
    frames = []
    while sub.poll(int(until_idle_s * 1000)):
        topic, seq, payload = sub.recv_multipart()
        frames.append((topic, int.from_bytes(seq, "big"), payload))
    return frames


def replay(ctx, endpoint: str, start: int) -> list[tuple[int, bytes]]:
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        got = []
        while True:
            assert sock.poll(3000), "the replay socket did not answer"
            _, _, seq, payload = sock.recv_multipart()
            if seq == END_SEQ:
                return got
            got.append((int.from_bytes(seq, "big"), payload))
    finally:
        sock.close(linger=0)


def prompts() -> list[list[int]]:
    """40-token prompts (2 full blocks; 4 output tokens do not fill a third): two sharing their
    first block, then enough distinct ones to evict from a 12-block cache."""
    shared = list(range(10, 10 + BS))
    out = [shared + list(range(100, 124)), shared + list(range(200, 224))]
    out += [list(range(300 + 40 * i, 340 + 40 * i)) for i in range(5)]
    return out


@pytest.mark.process
@pytest.mark.timeout(1800)  # a cold cache builds vLLM's environment first (minutes)
def test_vllms_own_classes_decode_the_real_engines_events(make_engine, tiny_model, tmp_path):
    ensure_vllm_cli()  # before the engine: a cold build must not time out the subscription
    endpoint, replay_endpoint = f"ipc://{tmp_path}/kv-pub", f"ipc://{tmp_path}/kv-replay"
    core = make_engine(tiny_model, max_model_len=128, num_kv_blocks=12, block_size=BS,
                       kv_events_config={"enable_kv_cache_events": True, "endpoint": endpoint,
                                         "replay_endpoint": replay_endpoint, "topic": "shoal"})
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    try:
        # ZeroMQ's slow joiner: reset (one AllBlocksCleared each) until the subscriber hears one
        deadline = time.monotonic() + 10
        while not sub.poll(50):
            assert core.reset_prefix_cache()
            assert time.monotonic() < deadline, "the subscriber never received an event"
        frames = receive(sub)
        for i, prompt in enumerate(prompts()):
            core.add_request(request(f"r{i}", prompt, max_tokens=4))
            run_to_completion(core)
        final_index = {wire_hash(h) for h in core.scheduler.kv.pool.cached}
        assert core.reset_prefix_cache()
        frames += receive(sub)
        ctx_replay = replay(ctx, replay_endpoint, frames[3][1])
    finally:
        sub.close(linger=0)
        ctx.term()
    seqs = [s for _, s, _ in frames]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), f"a gap in {seqs}"
    assert {t for t, _, _ in frames} == {b"shoal"}
    assert ctx_replay == [(s, p) for _, s, p in frames[3:]]  # the same bytes from seq onwards

    batches = decode_with_vllm([p for _, _, p in frames], tmp_path)
    assert all(b["data_parallel_rank"] == 0 and b["ts"] > 0 for b in batches)
    events = [e for b in batches for e in b["events"]]
    assert all(e["type"] == "AllBlocksCleared" for e in batches[0]["events"])
    index: dict[int, tuple[int | None, list[int]]] = {}  # hash -> (parent, tokens)
    removed = 0
    for e in events[len(batches[0]["events"]):-1]:
        if e["type"] == "BlockStored":
            assert e["block_size"] == BS and e["medium"] == "GPU" and e["lora_id"] is None
            assert len(e["token_ids"]) == BS * len(e["block_hashes"])
            parent = e["parent_block_hash"]
            assert parent is None or parent in index, "a parent hash nobody stored"
            for j, h in enumerate(e["block_hashes"]):
                index[h] = (parent, e["token_ids"][j * BS:(j + 1) * BS])
                parent = h
        else:
            assert e["type"] == "BlockRemoved" and e["medium"] == "GPU", e
            for h in e["block_hashes"]:
                assert h in index, "removed a block nobody stored"
                del index[h]
                removed += 1
    assert events[-1] == {"type": "AllBlocksCleared"}
    assert removed > 0, "the workload was sized to evict"
    assert set(index) == final_index  # the consumer's view is the engine's cache
    # every prompt's full blocks were stored along one chain (read back before evictions)
    chains = _chains(events)
    for prompt in prompts():
        assert prompt[:2 * BS] in chains


def _chains(events: list[dict]) -> list[list[int]]:
    """The token sequences from a root block along stored parent links (ignoring removals)."""
    blocks: dict[int, tuple[int | None, list[int]]] = {}
    for e in events:
        if e["type"] == "BlockStored":
            parent = e["parent_block_hash"]
            for j, h in enumerate(e["block_hashes"]):
                blocks[h] = (parent, e["token_ids"][j * BS:(j + 1) * BS])
                parent = h
    out = []
    for h in blocks:
        tokens, node = [], h
        while node is not None:
            parent, toks = blocks[node]
            tokens[:0] = toks
            node = parent
        out.append(tokens)
    return out


def test_the_config_crosses_to_the_engine_process_as_the_spawner_sends_it(tiny_model):
    """core_client/spawn.py sends EngineConfig's fields as JSON; the process rebuilds them."""
    import dataclasses

    config = EngineConfig(model=tiny_model, kv_events_config='{"enable_kv_cache_events": true}')
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
              if f.name not in ("architectures", "model_max_len")}
    again = EngineConfig(**msgspec.json.decode(msgspec.json.encode(fields)))
    assert again.kv_events_config == config.kv_events_config and again == config
    assert EngineConfig(model=tiny_model).kv_events_config is None
    with pytest.raises(ValueError, match="publisher must be"):
        EngineConfig(model=tiny_model, kv_events_config={"publisher": "kafka"})


def test_an_engine_without_the_flag_has_no_publisher_and_builds_nothing(make_engine, tiny_model):
    for events in (None, {"enable_kv_cache_events": True, "publisher": "null"},
                   {"publisher": "zmq"}):
        core = make_engine(tiny_model, max_model_len=128, kv_events_config=events)
        assert core.kv_event_publisher is None and core.scheduler.kv.pool.events is None
        core.add_request(request("x", list(range(10, 60)), max_tokens=2))
        run_to_completion(core)
        assert core.reset_prefix_cache() and core.scheduler.kv.pool.events is None


@pytest.mark.process
@pytest.mark.timeout(1800)
def test_the_replay_snapshot_is_the_engines_cache_in_vllms_classes(make_engine, tiny_model,
                                                                    tmp_path):
    """A replay from before the buffer (2 batches here) is answered with one snapshot batch:
    vLLM's classes decode it, it begins by clearing, and its blocks are exactly the engine's
    cached blocks, each with its parent stored before it and its own tokens."""
    ensure_vllm_cli()
    endpoint, replay_endpoint = f"ipc://{tmp_path}/kv-pub", f"ipc://{tmp_path}/kv-replay"
    core = make_engine(tiny_model, max_model_len=128, num_kv_blocks=12, block_size=BS,
                       kv_events_config={"enable_kv_cache_events": True, "endpoint": endpoint,
                                         "replay_endpoint": replay_endpoint,
                                         "buffer_steps": 2})
    for i, prompt in enumerate(prompts()):
        core.add_request(request(f"r{i}", prompt, max_tokens=4))
        run_to_completion(core)
    cached = {wire_hash(h) for h in core.scheduler.kv.pool.cached}
    ctx = zmq.Context()
    try:
        deadline = time.monotonic() + 10
        while True:  # the publisher thread sends what the engine queued, then answers
            answer = replay(ctx, replay_endpoint, 0)
            if len(answer) == 1 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        ctx.term()
    (seq, payload), = answer
    assert seq > 2  # the last batch sent, far past the buffer's start
    (snap,) = decode_with_vllm([payload], tmp_path)
    first, *stored = snap["events"]
    assert first == {"type": "AllBlocksCleared"}
    seen: dict[int, list[int]] = {}
    for e in stored:
        assert e["type"] == "BlockStored" and len(e["block_hashes"]) == 1, e
        assert e["block_size"] == BS and e["medium"] == "GPU" and len(e["token_ids"]) == BS
        parent = e["parent_block_hash"]
        assert parent is None or parent in seen or parent not in cached, "parent after child"
        seen[e["block_hashes"][0]] = e["token_ids"]
    assert set(seen) == cached and len(stored) == len(cached)
    # The tokens are the prompts' own: the last prompt (stored last, not evicted) reassembles
    # from its two blocks along their parent link.
    last = prompts()[-1]
    (root,) = [e for e in stored if e["token_ids"] == last[:BS]]
    assert root["parent_block_hash"] is None
    assert any(e["parent_block_hash"] == root["block_hashes"][0]
               and e["token_ids"] == last[BS:2 * BS] for e in stored)
