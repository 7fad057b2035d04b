"""KV cache events in vLLM 0.32's wire format (vllm/distributed/kv_events.py), so that the
consumers written for vLLM (llm-d's precise prefix routing, Dynamo's KV router, vllm-router's
kv_aware policy, Shoal's own routers) read a Shoal engine unchanged.

One ZeroMQ PUB message per engine step that changed the prefix cache, three frames:
  topic (utf-8, `topic` of --kv-events-config) | sequence number (8 bytes, big-endian,
  0, 1, 2, ... from engine start) | msgpack of an EventBatch
EventBatch is an array `[ts, events, data_parallel_rank]` (msgspec array_like): `ts` the wall
clock (time.time()) of the step, `data_parallel_rank` 0. Each event is a map tagged by its
class name under "type" (vLLM's KVCacheEvent: tag=True, not array_like), fields with defaults
omitted when they hold them:
- BlockStored {block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name, group_idx}: full blocks that entered the prefix-cache index, in chain order;
  token_ids are the len(block_hashes) * block_size tokens of those blocks, parent_block_hash the
  hash of the block before the first (None at the start of a prompt).
- BlockRemoved {block_hashes, medium, group_idx}: blocks evicted from the index.
- AllBlocksCleared {}: the prefix cache was reset (reset_prefix_cache); forget everything.
Hashes are Shoal's own chained block hashes as unsigned 64-bit integers (vLLM's default
VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES); they differ between engine processes (a per-process seed),
so a router keys blocks by its own hash of token_ids, as llm-d does. `medium` is "GPU": vLLM's
name for the engine's own KV cache whatever the device ("CPU" names its offloading tier,
which Shoal does not have); group_idx is 0, the one KV cache group. lora_id and lora_name are
the adapter's (--enable-lora; its blocks hash from a root of their own), None for the base.
The replay socket (kv_event_publisher.py) answers a request (one frame: the 8-byte start
sequence) with the buffered messages from there and an end marker.
tests/engine/test_kv_events_contract.py decodes Shoal's real events with vLLM's own classes.
"""

from __future__ import annotations

from typing import Any

import msgspec

MEDIUM = "GPU"
GROUP_IDX = 0
_U64 = (1 << 64) - 1


def wire_hash(block_hash: int) -> int:
    """Shoal's block hash (a signed Python hash) as the unsigned 64-bit integer on the wire."""
    return block_hash & _U64


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the three events (vLLM's: tagged by class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def block_stored(hashes: list[int], start: int, end: int, tokens: list[int],
                 block_size: int, lora=None) -> BlockStored:
    """BlockStored for blocks [start, end) of a request whose chained hashes are `hashes`;
    `lora`: its wire.LoRARequest (lora_id and lora_name, as vLLM's), None for the base model."""
    return BlockStored(
        block_hashes=[h & _U64 for h in hashes[start:end]],
        parent_block_hash=hashes[start - 1] & _U64 if start else None,
        token_ids=tokens[start * block_size:end * block_size], block_size=block_size,
        lora_id=None if lora is None else lora.lora_int_id, medium=MEDIUM,
        lora_name=None if lora is None else lora.lora_name, group_idx=GROUP_IDX)


def block_removed(hashes: list[int]) -> BlockRemoved:
    return BlockRemoved(block_hashes=[h & _U64 for h in hashes], medium=MEDIUM,
                        group_idx=GROUP_IDX)
