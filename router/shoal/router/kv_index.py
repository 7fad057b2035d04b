"""An exact index of which engine group holds which KV blocks, built from vLLM's KV events
(kv_wire.py), for `routing: kv-aware` (kv_score.py).

Keys: the router's own hash chain of token ids, h_i = hash((h_{i-1}, tuple(block i's token
ids))) from ROOT, as llm-d does, so engines need not share a hash seed (Python's hash of ints
and tuples of ints is not salted: the same in every router process). Blocks whose engine hash
folded in more than tokens (a LoRA name, multimodal or cache-salt extra keys) get that folded
into the router hash too, so a plain prompt never matches them. Per group the engine's block
hash maps to the router hash, which is how BlockRemoved and the next BlockStored's parent are
resolved; a BlockStored whose parent the index does not know (stored before the router
started and not in the replay) cannot be placed and is counted as an orphan.

Only the GPU tier (medium "GPU" or unset) is indexed: an offloaded tier's blocks are not the
engine's prefix cache and are counted as ignored.

Order and gaps: batches apply in sequence order. `apply` answers APPLIED, DUPLICATE (a batch
already applied, from a replay overlapping the live stream), or a `Gap(start)`: the caller
replays from `start` and feeds the replayed batches through `apply`; if the replay cannot
cover it, `accept_gap` clears that group (the index never claims a block whose removal it may
have missed) and continues from there, unless the replay's first batch begins with
AllBlocksCleared (a snapshot: Shoal's engine sends the whole cache when its buffer no longer
reaches back), which `accept_snapshot` takes as the complete state it is. A sequence that goes
back with a later batch time is a restarted engine (new epoch): the group is cleared and
replayed from 0. `set_epoch` (discovery:
a new pod uid or endpoint) clears it too.

Memory: bounded by `max_blocks` (group, block) entries, least recently stored or matched evicted
first, across groups. Measured cost (tests/router/test_kv_index.py, tracemalloc, CPython 3.11,
vLLM's 32-byte block hashes, 16-token blocks): about 430 bytes per (group, block) entry, so the
default 500,000 entries (ten groups of a 50,000-block KV cache) is about 215 MB at most.
Pure bookkeeping: the caller passes `now`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field

from shoal.router.kv_wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

ROOT = 0
MAX_BLOCKS = 500_000
STALE_S = 30.0  # traffic and no batch this long: stale
DISCONNECTED_S = 3.0  # the publisher's connection down (or never up) this long: stale
GPU_MEDIA = ("GPU", None)

APPLIED = "applied"
DUPLICATE = "duplicate"

GroupKey = Hashable


@dataclass(frozen=True)
class Gap:
    """Batches from `start` up to (not including) the one offered are missing."""

    start: int


def iter_chain(token_ids, block_size: int, parent: int = ROOT, extra=None):
    """The router hashes of the whole blocks of `token_ids`, first block first, lazily (a
    lookup stops at the first block no group holds)."""
    for i in range(len(token_ids) // block_size):
        block = tuple(token_ids[i * block_size:(i + 1) * block_size])
        parent = hash((parent, block) if extra is None else (parent, block, extra))
        yield parent


def chain(token_ids, block_size: int, parent: int = ROOT, extra=None) -> list[int]:
    return list(iter_chain(token_ids, block_size, parent, extra))


@dataclass
class _Group:
    epoch: object = None
    last_seq: int | None = None
    last_ts: float = 0.0
    last_batch_at: float | None = None
    traffic_since: float | None = None  # first request routed to it since its last batch
    gap_at: int | None = None  # the start of the gap last reported
    down_since: float | None = None  # when its publisher's connection went (None: it is up)
    block_size: int | None = None
    blocks: int = 0  # its (group, router hash) entries
    engine_to_router: dict = field(default_factory=dict)


@dataclass(frozen=True)
class IndexStats:
    blocks: int
    groups: int
    gaps: int
    unrepaired_gaps: int
    orphans: int
    ignored: int
    evicted: int
    lag_s: dict
    stale: tuple
    snapshots: int = 0


class KvIndex:
    def __init__(self, max_blocks: int = MAX_BLOCKS, stale_after: float = STALE_S,
                 disconnected_after: float = DISCONNECTED_S) -> None:
        self.max_blocks = max_blocks
        self.stale_after = stale_after
        self.disconnected_after = disconnected_after
        self._groups: dict[GroupKey, _Group] = {}
        # (group, router hash) -> the group's engine hash(es) that map to it; LRU order.
        self._lru: OrderedDict[tuple[GroupKey, int], object] = OrderedDict()
        self._where: dict[int, object] = {}  # router hash -> the group (or set) holding it
        self.stale: set = set()
        self.gaps = self.unrepaired_gaps = self.orphans = self.ignored = self.evicted = 0
        self.snapshots = 0
        self.malformed = 0

    # ----- groups ---------------------------------------------------------------------------

    def set_epoch(self, group: GroupKey, epoch: object) -> None:
        """The group's engine identity (discovery: pod uid, endpoint); a new one clears it."""
        g = self._groups.get(group)
        if g is None:
            self._groups[group] = _Group(epoch=epoch)
        elif g.epoch != epoch:
            self.clear(group)
            self._groups[group] = _Group(epoch=epoch)

    def drop(self, group: GroupKey) -> None:
        """The group left discovery: its entries go."""
        self.clear(group)
        self._groups.pop(group, None)
        self.stale.discard(group)

    def clear(self, group: GroupKey) -> None:
        g = self._groups.get(group)
        if g is None:
            return
        for eh, rh in list(g.engine_to_router.items()):
            self._forget(group, rh, eh)
        g.engine_to_router.clear()

    def groups(self) -> list:
        return list(self._groups)

    # ----- events ---------------------------------------------------------------------------

    def apply(self, group: GroupKey, seq: int, batch: KVEventBatch, now: float):
        """Apply one batch in order: APPLIED, DUPLICATE, or Gap(start) (nothing applied)."""
        g = self._groups.setdefault(group, _Group())
        if g.last_seq is not None and seq <= g.last_seq:
            if batch.ts <= g.last_ts:
                return DUPLICATE
            self.clear(group)  # the sequence restarted with newer batches: a new engine
            g.last_seq, g.last_ts, g.block_size = None, 0.0, None
        expected = 0 if g.last_seq is None else g.last_seq + 1
        if seq != expected:
            if g.gap_at != expected:  # asked again after a replay: the same gap, counted once
                g.gap_at = expected
                self.gaps += 1
            return Gap(expected)
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(group, g, event)
            elif isinstance(event, BlockRemoved):
                if event.medium in GPU_MEDIA:
                    for eh in event.block_hashes:
                        rh = g.engine_to_router.pop(eh, None)
                        if rh is not None:
                            self._forget(group, rh, eh)
                else:
                    self.ignored += 1
            elif isinstance(event, AllBlocksCleared):
                self.clear(group)
        g.last_seq, g.last_ts, g.last_batch_at, g.traffic_since = seq, batch.ts, now, None
        self._evict()
        return APPLIED

    def accept_gap(self, group: GroupKey, seq: int) -> None:
        """The replay could not cover a gap before `seq`: clear the group, go on from `seq`."""
        self.unrepaired_gaps += 1
        self.clear(group)
        g = self._groups.setdefault(group, _Group())
        g.last_seq = seq - 1

    def accept_snapshot(self, group: GroupKey, seq: int) -> None:
        """The replay answered a gap before `seq` with batch `seq` beginning AllBlocksCleared:
        a complete state (Shoal's engine sends one when its buffer no longer reaches back), so
        nothing is missed; the caller applies it next."""
        self.snapshots += 1
        self.clear(group)
        g = self._groups.setdefault(group, _Group())
        g.last_seq = seq - 1

    def router_hashes(self, group: GroupKey) -> frozenset:
        """The router hashes of the blocks the index holds for `group`."""
        g = self._groups.get(group)
        return frozenset(g.engine_to_router.values()) if g else frozenset()

    def _stored(self, group: GroupKey, g: _Group, ev: BlockStored) -> None:
        if ev.medium not in GPU_MEDIA:
            self.ignored += 1
            return
        g.block_size = ev.block_size
        if ev.parent_block_hash is None:
            parent = ROOT
        else:
            parent = g.engine_to_router.get(ev.parent_block_hash)
            if parent is None:
                self.orphans += len(ev.block_hashes)
                return
        extra = None
        if ev.lora_name is not None or ev.extra_keys:
            extra = (ev.lora_name, repr(ev.extra_keys))
        hashes = chain(ev.token_ids, ev.block_size, parent, extra)
        if len(hashes) != len(ev.block_hashes):  # not vLLM's shape: placing it would guess
            self.malformed += 1
            return
        for eh, rh in zip(ev.block_hashes, hashes, strict=True):
            old = g.engine_to_router.get(eh)
            if old == rh:
                self._lru.move_to_end((group, rh))
                continue
            if old is not None:
                self._forget(group, old, eh)
            g.engine_to_router[eh] = rh
            key = (group, rh)
            held = self._lru.get(key)
            if held is None:
                self._lru[key] = eh
                g.blocks += 1
                self._hold(rh, group)
            else:  # a second engine hash for the same tokens (rare): keep both
                self._lru[key] = [*held, eh] if isinstance(held, list) else [held, eh]
                self._lru.move_to_end(key)

    # Compact values (the per-block cost): one engine hash or a list of them; one holding
    # group key or a set of them.

    def _hold(self, rh: int, group: GroupKey) -> None:
        holders = self._where.get(rh)
        if holders is None:
            self._where[rh] = group
        elif isinstance(holders, set):
            holders.add(group)
        elif holders != group:
            self._where[rh] = {holders, group}

    def _release(self, rh: int, group: GroupKey) -> None:
        holders = self._where.get(rh)
        if holders == group:
            del self._where[rh]
        elif isinstance(holders, set):
            holders.discard(group)
            if len(holders) == 1:
                (self._where[rh],) = holders

    def _holders(self, rh: int) -> set:
        holders = self._where.get(rh)
        if holders is None:
            return set()
        return holders if isinstance(holders, set) else {holders}

    def _forget(self, group: GroupKey, rh: int, eh) -> None:
        """The group's engine hash `eh` (mapped to `rh`) is gone."""
        key = (group, rh)
        held = self._lru.get(key)
        if held is None:
            return
        if isinstance(held, list):
            rest = [h for h in held if h != eh]
            if rest:
                self._lru[key] = rest if len(rest) > 1 else rest[0]
                return
        elif held != eh:
            return
        del self._lru[key]
        self._groups[group].blocks -= 1
        self._release(rh, group)

    def _evict(self) -> None:
        while len(self._lru) > self.max_blocks:
            (group, rh), held = self._lru.popitem(last=False)
            g = self._groups.get(group)
            if g is not None:
                g.blocks -= 1
                for eh in held if isinstance(held, list) else (held,):
                    g.engine_to_router.pop(eh, None)
            self._release(rh, group)
            self.evicted += 1

    # ----- lookups --------------------------------------------------------------------------

    def longest_prefix(self, token_ids) -> dict:
        """{group: cached tokens}: per group, the whole leading blocks of `token_ids` it holds
        (a prefix hit stops at the first missing block, as the engine's does). Matched blocks
        count as recently used."""
        out: dict = {}
        by_size: dict[int, list] = {}
        for key, g in self._groups.items():
            if g.block_size:
                by_size.setdefault(g.block_size, []).append(key)
        for size, groups in by_size.items():
            alive = set(groups)
            for i, rh in enumerate(iter_chain(token_ids, size)):
                alive &= self._holders(rh)
                if not alive:
                    break
                for group in alive:
                    out[group] = (i + 1) * size
                    self._lru.move_to_end((group, rh))
        return out

    # ----- freshness ------------------------------------------------------------------------

    def note_traffic(self, group: GroupKey, now: float) -> None:
        """A request was routed to `group`: if no batch follows within stale_after, it is stale
        (long: a request whose prompt was all cached and whose output fills no block sends
        none)."""
        g = self._groups.setdefault(group, _Group())
        if g.traffic_since is None:
            g.traffic_since = now

    def set_connected(self, group: GroupKey, connected: bool, now: float) -> None:
        """The subscription's connection to the group's publisher came up or went down (ZMQ's
        socket monitor): down for disconnected_after makes the group stale."""
        g = self._groups.setdefault(group, _Group())
        if connected:
            g.down_since = None
        elif g.down_since is None:
            g.down_since = now

    def why_stale(self, group: GroupKey, now: float) -> str | None:
        g = self._groups.get(group)
        if g is None:
            return None
        if g.down_since is not None and now - g.down_since > self.disconnected_after:
            return f"no connection to its publisher for {now - g.down_since:.0f} s"
        if g.traffic_since is not None and now - g.traffic_since > self.stale_after:
            return f"no batch for {now - g.traffic_since:.0f} s while it had traffic"
        return None

    def refresh_stale(self, now: float) -> tuple[set, set]:
        """Recompute the stale set: (groups that became stale, groups that recovered)."""
        stale = {k for k in self._groups if self.why_stale(k, now) is not None}
        became, recovered = stale - self.stale, self.stale - stale
        self.stale = stale
        return became, recovered

    def stats(self, now: float) -> IndexStats:
        return IndexStats(
            blocks=len(self._lru), groups=len(self._groups), gaps=self.gaps,
            unrepaired_gaps=self.unrepaired_gaps, orphans=self.orphans, ignored=self.ignored,
            evicted=self.evicted,
            lag_s={k: now - g.last_batch_at for k, g in self._groups.items()
                   if g.last_batch_at is not None},
            stale=tuple(sorted(self.stale, key=repr)), snapshots=self.snapshots)

    def last_seq(self, group: GroupKey) -> int | None:
        """The sequence number of the group's last applied batch; None before its first."""
        g = self._groups.get(group)
        return None if g is None else g.last_seq

    def blocks_of(self, group: GroupKey) -> int:
        g = self._groups.get(group)
        return 0 if g is None else g.blocks
