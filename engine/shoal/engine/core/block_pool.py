"""The pool of KV cache blocks: free queue, reference counts, the prefix-cache index.

- Block 0 is the null block: never handed out, used to pad block tables.
- Free blocks sit in one doubly linked queue, so a block can leave from the middle in O(1)
  when a prefix-cache hit revives it. Blocks without a hash are freed to the front and reused
  first (LIFO: their contents are worthless); cached blocks are freed to the back and evicted
  from the front, oldest first (LRU), so useful prefixes survive as long as possible.
- A block with ref_cnt > 0 is in use by that many requests and never in the free queue.
- KV events (core/kv_events.py): `events` is None unless the engine publishes them, and then
  collects BlockRemoved (evictions from the index) and AllBlocksCleared (a reset) until the
  engine takes them after its step; the KV cache manager adds BlockStored. None costs nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

from shoal.engine.core import kv_events


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None  # set once the block is full and cached
        self.prev: KVBlock | None = None
        self.next: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with sentinels at both ends."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self._head.next
        if block is self._tail:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.num_free -= 1

    def _insert_after(self, anchor: KVBlock, block: KVBlock) -> None:
        block.prev, block.next = anchor, anchor.next
        anchor.next.prev = block
        anchor.next = block
        self.num_free += 1

    def append(self, block: KVBlock) -> None:
        self._insert_after(self._tail.prev, block)

    def appendleft(self, block: KVBlock) -> None:
        self._insert_after(self._head, block)

    def block_ids(self) -> list[int]:
        out, node = [], self._head.next
        while node is not self._tail:
            out.append(node.block_id)
            node = node.next
        return out


class BlockPool:
    """Owns every KVBlock. The KV cache manager is its only user."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"need at least 2 KV blocks (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # permanently in use: never freed, never handed out
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached: dict[int, KVBlock] = {}  # block hash -> block holding those tokens
        self.events: list | None = None  # KV events of this step; None: none are built

    def enable_events(self) -> None:
        self.events = []

    def take_events(self) -> list:
        """The events since the last call (the engine publishes them once a step)."""
        out, self.events = self.events, []
        return out

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (cached-but-free blocks count as free)."""
        usable = self.num_blocks - 1
        return 1.0 - self.num_free_blocks / usable if usable else 0.0

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take n blocks from the free queue (evicting their cached contents), ref_cnt 1."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks with only {self.num_free_blocks} free")
        out, removed = [], None
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                gone = self._evict(block)
                if gone is not None and self.events is not None:
                    removed = removed or []
                    removed.append(gone)
            block.ref_cnt = 1
            out.append(block)
        if removed:
            self.events.append(kv_events.block_removed(removed))
        return out

    def _evict(self, block: KVBlock) -> int | None:
        """Drop the block's hash; the hash when it left the index (a duplicate was not in it)."""
        block_hash, block.block_hash = block.block_hash, None
        if self.cached.get(block_hash) is block:
            del self.cached[block_hash]
            return block_hash
        return None

    def lookup(self, block_hash: int) -> KVBlock | None:
        return self.cached.get(block_hash)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-cache hits; a free hit leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def cache_block(self, block: KVBlock, block_hash: int) -> bool:
        """Index a full block under its chained hash (first writer wins on duplicates); whether
        the hash entered the index (what a BlockStored event reports)."""
        if block.block_hash is not None:
            return False
        block.block_hash = block_hash
        return self.cached.setdefault(block_hash, block) is block

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; blocks that reach 0 go back to the free queue.

        Pass a request's blocks tail first, so its last blocks are evicted before its prefix."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"double free of KV block {block.block_id}")
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no request holds a block."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        for block in self.blocks[1:]:
            block.block_hash = None
        self.cached.clear()
        if self.events is not None:
            self.events.append(kv_events.AllBlocksCleared())
        return True
