"""The KV events index (kv_index.py): stores, removals, clears, engine epochs, the memory bound
and its measured per-block cost, gaps and duplicates, staleness."""

from __future__ import annotations

import tracemalloc

import pytest
from shoal.router.kv_index import APPLIED, DUPLICATE, Gap, KvIndex, chain
from shoal.router.kv_wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

G0, G1 = ("", 0), ("", 1)
T = list(range(100, 112))  # three blocks of 4
U = list(range(500, 508))


def stored(hashes, tokens, parent=None, bs=4, medium="GPU", lora=None):
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                       block_size=bs, lora_id=None, medium=medium, lora_name=lora)


def removed(hashes, medium="GPU"):
    return BlockRemoved(block_hashes=hashes, medium=medium)


class Feed:
    """Applies batches to one group of an index in sequence order."""

    def __init__(self, index: KvIndex, group=G0) -> None:
        self.index, self.group, self.seq, self.ts = index, group, 0, 1.0

    def __call__(self, *events):
        verdict = self.index.apply(self.group, self.seq, KVEventBatch(self.ts, list(events)),
                                   self.ts)
        assert verdict == APPLIED
        self.seq += 1
        self.ts += 1.0


def test_a_stored_chain_is_found_by_the_routers_own_hashes():
    index = KvIndex()
    feed = Feed(index)
    feed(stored([b"\x01", b"\x02"], T[:8]))
    feed(stored([b"\x03"], T[8:12], parent=b"\x02"))
    assert index.longest_prefix(T + [9]) == {G0: 12}
    assert index.longest_prefix(T[:7]) == {G0: 4}  # whole blocks only
    assert index.longest_prefix(U) == {}
    assert index.stats(0).blocks == 3 and index.blocks_of(G0) == 3


def test_engines_with_different_hash_seeds_match_the_same_prompt():
    index = KvIndex()
    Feed(index, G0)(stored([11, 12], T[:8]))
    Feed(index, G1)(stored([b"\xaa" * 32, b"\xbb" * 32], T[:8]))
    assert index.longest_prefix(T) == {G0: 8, G1: 8}


@pytest.mark.parametrize("name, after, expected", [
    ("removing the middle block stops the prefix there", [removed([2])], {G0: 4}),
    ("removing the first block loses it all", [removed([1])], {}),
    ("removing an unknown block changes nothing", [removed([99])], {G0: 12}),
    ("another tier's removal is not the GPU's", [removed([2], medium="CPU")], {G0: 12}),
    ("all blocks cleared", [AllBlocksCleared()], {}),
    ("removed then stored again", [removed([3]), stored([33], T[8:12], parent=2)], {G0: 12}),
])
def test_removals_and_clears(name, after, expected):
    index = KvIndex()
    feed = Feed(index)
    feed(stored([1, 2, 3], T))
    feed(*after)
    assert index.longest_prefix(T) == expected, name


def test_blocks_the_index_cannot_place_are_not_indexed():
    index = KvIndex()
    feed = Feed(index)
    feed(stored([7], T[4:8], parent=6))  # its parent was stored before the router started
    feed(stored([8], U[:4], medium="CPU"))  # an offloaded tier, not the prefix cache
    feed(stored([9], U[:4], lora="adapter"))  # a LoRA's block: a plain prompt is not its prefix
    feed(stored([10, 11], U[:4]))  # not vLLM's shape: 2 hashes for 1 block of tokens
    assert index.longest_prefix(T) == {} and index.longest_prefix(U) == {}
    st = index.stats(0)
    assert (st.orphans, st.ignored, st.blocks) == (1, 1, 1)  # the LoRA block is held, apart
    assert index.malformed == 1


def test_gaps_are_reported_before_anything_is_applied_and_duplicates_skipped():
    index = KvIndex()
    b = [KVEventBatch(float(i + 1), [stored([i + 1], T[4 * i:4 * i + 4],
                                            parent=i or None)]) for i in range(3)]
    assert index.apply(G0, 0, b[0], 1.0) == APPLIED
    assert index.apply(G0, 2, b[2], 2.0) == Gap(1)
    assert index.longest_prefix(T) == {G0: 4}  # batch 2 was held back
    assert index.apply(G0, 1, b[1], 2.0) == APPLIED  # the replay, in order
    assert index.apply(G0, 2, b[2], 2.0) == APPLIED
    assert index.apply(G0, 1, b[1], 3.0) == DUPLICATE  # a replay overlapping the live stream
    assert index.longest_prefix(T) == {G0: 12}
    assert index.stats(0).gaps == 1


def test_a_router_that_starts_late_asks_from_0_and_an_uncovered_gap_clears_the_group():
    index = KvIndex()
    assert index.apply(G0, 5, KVEventBatch(1.0, [stored([1], T[:4])]), 1.0) == Gap(0)
    index.accept_gap(G0, 5)
    assert index.apply(G0, 5, KVEventBatch(1.0, [stored([1], T[:4])]), 1.0) == APPLIED
    assert index.apply(G0, 7, KVEventBatch(2.0, []), 2.0) == Gap(6)
    index.accept_gap(G0, 7)  # batch 6 may have removed block 1: it is not trusted any more
    assert index.longest_prefix(T) == {}
    assert index.stats(0).unrepaired_gaps == 2


def test_a_sequence_that_restarts_with_newer_batches_is_a_new_engine():
    index = KvIndex()
    feed = Feed(index)
    feed(stored([1, 2], T[:8]))
    feed(stored([3], T[8:12], parent=2))
    assert index.apply(G0, 0, KVEventBatch(50.0, [stored([41], U[:4])]), 50.0) == APPLIED
    assert index.longest_prefix(T) == {} and index.longest_prefix(U) == {G0: 4}


def test_a_late_restart_is_replayed_from_0():
    index = KvIndex()
    feed = Feed(index)
    for i in range(4):
        feed(stored([i + 1], T[4 * (i % 3):4 * (i % 3) + 4], parent=i or None))
    assert index.apply(G0, 2, KVEventBatch(100.0, [stored([9], U[:4])]), 100.0) == Gap(0)
    assert index.longest_prefix(T) == {}


def test_a_new_epoch_from_discovery_clears_the_group_the_same_one_keeps_it():
    index = KvIndex()
    index.set_epoch(G0, "uid-1")
    Feed(index)(stored([1], T[:4]))
    index.set_epoch(G0, "uid-1")
    assert index.longest_prefix(T) == {G0: 4}
    index.set_epoch(G0, "uid-2")
    assert index.longest_prefix(T) == {} and index.stats(0).blocks == 0
    assert index.apply(G0, 0, KVEventBatch(1.0, [stored([1], T[:4])]), 1.0) == APPLIED
    index.drop(G0)
    assert index.groups() == [] and index.longest_prefix(T) == {}


def test_the_memory_bound_evicts_the_least_recently_used_across_groups():
    index = KvIndex(max_blocks=3)
    f0, f1 = Feed(index, G0), Feed(index, G1)
    f0(stored([1, 2], T[:8]))
    f1(stored([5], U[:4]))
    assert index.longest_prefix(T) == {G0: 8}  # a match refreshes G0's two blocks
    f0(stored([3], T[8:12], parent=2))  # a 4th entry: G1's block is the least recently used
    assert index.stats(0).blocks == 3 and index.stats(0).evicted == 1
    assert index.longest_prefix(U) == {} and index.longest_prefix(T) == {G0: 12}
    f1(stored([7], T[:4]))  # now G0's first block is the oldest: without it G0 has no prefix
    assert index.longest_prefix(T) == {G1: 4}
    f0(removed([1]))  # its engine hash went with the entry: nothing to remove, no error
    assert index.blocks_of(G0) == 2 and index.blocks_of(G1) == 1


def test_a_group_with_traffic_and_no_batches_goes_stale_and_recovers():
    index = KvIndex(stale_after=10.0)
    Feed(index)(stored([1], T[:4]))
    assert index.refresh_stale(5.0) == (set(), set())
    index.note_traffic(G0, 5.0)
    index.note_traffic(G0, 9.0)  # the first unanswered request counts
    assert index.refresh_stale(14.0) == (set(), set())
    assert index.refresh_stale(15.5) == ({G0}, set())
    assert index.refresh_stale(16.0) == (set(), set())  # one transition, reported once
    assert index.stats(16.0).stale == (G0,)
    index.apply(G0, 1, KVEventBatch(2.0, []), 17.0)
    assert index.refresh_stale(17.0) == (set(), {G0})
    assert index.stats(20.0).lag_s == {G0: 3.0}


def test_chain_is_deterministic_and_position_dependent():
    assert chain(T, 4) == chain(list(T), 4)
    assert chain(T[4:8] + T[:4], 4)[1] != chain(T, 4)[0]
    assert len(chain(T[:11], 4)) == 2


def test_the_per_block_cost_is_what_the_docstring_says():
    """A realistic shape: 200 prompts of 32 blocks of 16 tokens on each of 2 groups, vLLM's
    32-byte hashes. The docstring of kv_index.py states the measured number."""
    index = KvIndex()
    feeds = [Feed(index, G0), Feed(index, G1)]
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    n = 0
    for p in range(200):
        tokens = [p * 100_000 + t for t in range(32 * 16)]
        for g, feed in enumerate(feeds):
            hashes = [bytes([g, p % 256, p // 256, i]) * 8 for i in range(32)]
            feed(stored(hashes, tokens, bs=16))
            n += 32
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
    per_block = grown / n
    print(f"KV index: {per_block:.0f} bytes per (group, block) entry over {n} entries")
    assert index.stats(0).blocks == n
    assert 300 < per_block < 500, per_block  # the docstring says about 430


def test_a_group_whose_publisher_is_unreachable_goes_stale_after_the_grace():
    index = KvIndex(disconnected_after=3.0)
    index.set_connected(G0, False, 10.0)
    assert index.refresh_stale(12.0) == (set(), set())
    assert index.refresh_stale(13.5) == ({G0}, set())
    assert index.why_stale(G0, 13.5) == "no connection to its publisher for 4 s"
    index.set_connected(G0, False, 14.0)  # still down: counted from the first
    index.set_connected(G0, True, 15.0)
    assert index.refresh_stale(15.0) == (set(), {G0})
