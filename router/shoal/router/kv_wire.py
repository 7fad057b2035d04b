"""vLLM 0.32's KV event wire (`vllm/distributed/kv_events.py`), decoded without vLLM.

A publisher (vLLM's ZmqEventPublisher, or a Shoal engine speaking its format) sends ZMQ
multipart messages (topic, 8-byte big-endian sequence number, msgpack `KVEventBatch`). The
batch is an array (ts, events, data_parallel_rank); each event is a map tagged by its class
name under "type" (BlockStored, BlockRemoved, AllBlocksCleared). The structs below repeat
vLLM's field order and defaults; unknown fields a later vLLM adds are ignored by msgspec, a
missing required field is a DecodeError naming it. The replay socket answers the same
(topic, seq, payload) frames and ends with seq -1 and an empty payload (END_SEQ).
"""

from __future__ import annotations

from typing import Any

import msgspec

# vLLM's ExternalBlockHash: bytes (sha256-based hashing) or int (builtin hashing).
BlockHash = bytes | int
END_SEQ = -1


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """One batch's msgpack payload; msgspec.DecodeError says what does not match vLLM's."""
    return _decoder.decode(payload)


def decode_seq(frame: bytes) -> int:
    """The 8-byte big-endian sequence frame (signed: the replay's end marker is -1)."""
    if len(frame) != 8:
        raise ValueError(f"sequence frame of {len(frame)} bytes, not 8")
    return int.from_bytes(frame, "big", signed=True)


def encode_seq(seq: int) -> bytes:
    """A replay request's start sequence, as vLLM's ROUTER reads it."""
    return seq.to_bytes(8, "big", signed=seq < 0)
