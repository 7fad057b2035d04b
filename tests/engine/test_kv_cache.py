"""Block pool and KV cache manager: free-queue order, reference counts, prefix hits."""

from __future__ import annotations

import pytest
from shoal.engine import wire
from shoal.engine.core.block_pool import BlockPool
from shoal.engine.core.kv_cache_manager import KVCacheManager
from shoal.engine.core.request import Request


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, wire.SamplingParams(max_tokens=4), 4)


def test_null_block_is_never_handed_out():
    pool = BlockPool(4)
    got = pool.get_new_blocks(3)
    assert 0 not in [b.block_id for b in got]
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)


def test_uncached_blocks_are_reused_lifo_and_cached_ones_evicted_lru():
    pool = BlockPool(6)  # usable 1..5
    a, b, c, d, e = pool.get_new_blocks(5)
    pool.cache_block(a, 111)
    pool.cache_block(b, 222)
    pool.free_blocks([a, b, c, d])  # a, b cached -> back of queue; c, d uncached -> front
    assert pool.free_queue.block_ids() == [d.block_id, c.block_id, a.block_id, b.block_id]
    first, second, third = pool.get_new_blocks(3)
    assert (first, second, third) == (d, c, a)  # uncached first (LIFO), then the oldest cached
    assert pool.lookup(111) is None and pool.lookup(222) is b  # a was evicted, b survives


def test_touching_a_free_cached_block_takes_it_off_the_free_queue():
    pool = BlockPool(4)
    (blk,) = pool.get_new_blocks(1)
    pool.cache_block(blk, 7)
    pool.free_blocks([blk])
    assert pool.num_free_blocks == 3
    pool.touch([blk])
    assert blk.ref_cnt == 1 and pool.num_free_blocks == 2
    pool.touch([blk])
    pool.free_blocks([blk])
    assert pool.num_free_blocks == 2
    pool.free_blocks([blk])
    assert pool.num_free_blocks == 3
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([blk])


def test_allocate_returns_none_and_changes_nothing_when_blocks_run_out():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_caching=False)  # 3 usable
    r = req("a", list(range(10)))
    assert kv.allocate_slots(r, 10) is not None
    r.num_computed_tokens = 10
    assert kv.num_free_blocks == 0
    assert kv.allocate_slots(r, 3) is None  # would need a 4th block
    assert len(kv.block_ids("a")) == 3
    kv.free(r)
    kv.free(r)  # idempotent
    assert kv.num_free_blocks == 3


def test_prefix_hit_covers_whole_blocks_but_never_the_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = req("a", list(range(12)))
    kv.allocate_slots(first, 12)
    kv.free(first)
    same = req("b", list(range(12)))  # identical prompt: at most 11 tokens may hit -> 2 blocks
    blocks, n = kv.get_computed_blocks(same)
    assert n == 8 and len(blocks) == 2
    longer = req("c", list(range(12)) + [99])
    blocks, n = kv.get_computed_blocks(longer)
    assert n == 12
    other = req("d", [5] + list(range(1, 12)))  # differs in the first block: chained hash misses
    assert kv.get_computed_blocks(other) == ([], 0)


def test_prefix_caching_off_never_hits():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=False)
    first = req("a", list(range(12)))
    kv.allocate_slots(first, 12)
    kv.free(first)
    assert kv.get_computed_blocks(req("b", list(range(13)))) == ([], 0)


def test_hit_blocks_are_shared_by_reference_count():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = req("a", list(range(9)))
    kv.allocate_slots(a, 9)
    b = req("b", list(range(9)))
    hit, n = kv.get_computed_blocks(b)
    assert n == 8
    kv.allocate_slots(b, 1, hit)
    assert kv.block_ids("a")[:2] == kv.block_ids("b")[:2]
    assert all(blk.ref_cnt == 2 for blk in hit)
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 15
