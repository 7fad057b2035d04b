"""KVCacheManager: which blocks each request holds, and prefix-cache lookups.

Contract with the scheduler:
- `get_computed_blocks(request)` -> (blocks, num_tokens): the longest cached prefix of a
  request that has computed nothing yet, in whole blocks and never the last token (the last
  prompt token must be recomputed to produce logits). It takes no references.
- `allocate_slots(request, num_new_tokens, computed_blocks)` -> list of newly allocated
  blocks, or None when the pool cannot cover the request's computed + new tokens. None changes
  nothing: the scheduler decides what to preempt and asks again.
- `free(request)` releases every block of a finished or preempted request. It is idempotent.
- `block_ids(request_id)` is the request's block table, in order.
Full blocks are indexed under chained hashes hash(parent_hash, tokens) as soon as the step
that writes them is scheduled, so later requests sharing the prefix hit them. With KV events
on (`pool.events` not None) each run of blocks that entered the index is one BlockStored
(core/kv_events.py); with them off nothing is built.
"""

from __future__ import annotations

from shoal.engine.core import kv_events
from shoal.engine.core.block_pool import BlockPool, KVBlock
from shoal.engine.core.request import Request

_ROOT_HASH = hash("shoal-kv-root")


def hash_block(parent_hash: int, tokens: tuple[int, ...]) -> int:
    return hash((parent_hash, tokens))


def root_hash(request: Request) -> int:
    """The chain's start: the base model's, or one per LoRA adapter (name and id), so blocks
    are never shared across adapters or between an adapter and the base model (vLLM folds the
    adapter into every block hash's extra keys the same way)."""
    lora = request.lora_request
    if lora is None:
        return _ROOT_HASH
    return hash((_ROOT_HASH, lora.lora_name, lora.lora_int_id))


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # blocks of the request already indexed
        # Prefix-cache counters in tokens, drained by the scheduler into SchedulerStats.
        self.queries = 0
        self.hits = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def _update_hashes(self, request: Request) -> None:
        hashes, bs = request.block_hashes, self.block_size
        tokens = request.all_token_ids
        while (len(hashes) + 1) * bs <= len(tokens):
            start = len(hashes) * bs
            parent = hashes[-1] if hashes else root_hash(request)
            hashes.append(hash_block(parent, tuple(tokens[start:start + bs])))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        if not self.enable_caching:
            return [], 0
        self._update_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hit: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hit.append(block)
        return hit, len(hit) * self.block_size

    def record_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted lookup (retries of a request that did not fit are not counted)."""
        if self.enable_caching:
            self.queries += num_query_tokens
            self.hits += num_hit_tokens

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[KVBlock] | None = None
    ) -> list[KVBlock] | None:
        computed_blocks = computed_blocks or []
        held = self.req_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        total_tokens = num_computed + num_new_tokens
        needed = -(-total_tokens // self.block_size) - len(held) - len(computed_blocks)
        # Hits that sit in the free queue stop counting as free once we take them.
        revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if max(needed, 0) > self.pool.num_free_blocks - revived:
            return None
        self.pool.touch(computed_blocks)
        new_blocks = self.pool.get_new_blocks(needed) if needed > 0 else []
        blocks = self.req_blocks.setdefault(request.request_id, [])
        blocks.extend(computed_blocks)
        blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, min(total_tokens, request.num_tokens))
        return new_blocks

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        rid = request.request_id
        done = self.num_cached_blocks.get(rid, 0)
        full = num_tokens // self.block_size
        if full <= done:
            return
        self._update_hashes(request)
        if self.pool.events is None:
            for i in range(done, full):
                self.pool.cache_block(blocks[i], request.block_hashes[i])
        else:
            self._cache_and_report(request, blocks, done, full)
        self.num_cached_blocks[rid] = full

    def _cache_and_report(self, request: Request, blocks: list[KVBlock], done: int,
                          full: int) -> None:
        """Index blocks [done, full) and report each unbroken run of those that entered the
        index (a block whose tokens another block already holds breaks a run)."""
        hashes, start = request.block_hashes, None
        for i in range(done, full + 1):
            if i < full and self.pool.cache_block(blocks[i], hashes[i]):
                start = i if start is None else start
            elif start is not None:
                self.pool.events.append(kv_events.block_stored(
                    hashes, start, i, request.all_token_ids, self.block_size,
                    request.lora_request))
                start = None

    def free(self, request: Request) -> None:
        blocks = self.req_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def take_prefix_stats(self) -> tuple[int, int]:
        out = (self.queries, self.hits)
        self.queries = self.hits = 0
        return out

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
