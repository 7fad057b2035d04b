"""Prefix-affinity routing (`routing: prefix-affinity`): requests whose prompts start alike go to
the same engine group, so that group's prefix cache (vLLM's automatic prefix caching, Shoal's
paged KV cache) serves the shared part instead of computing it again on another group.

How: the router has no tokenizer, so a prompt's text (`prompt_text`) is cut into chunks of
CHUNK_CHARS characters and each chunk gets a chained hash (key i covers characters
0 .. (i+1)*CHUNK_CHARS); only whole chunks count. A table maps each key to the group that last
served a prompt with that prefix. A new request goes to the owner of its longest known key, as
long as that group is usable and its outstanding requests exceed the least-loaded candidate's by
at most `imbalance` (the load bound); otherwise to the owner of a shorter known prefix within
the bound; else the picker's least-outstanding rule chooses, and the chosen group claims the keys
that had no live owner. A busy owner keeps its claim, so a burst
spills over without moving the prefix's home for good. Claims expire after `ttl` seconds (the
engines' caches evict too) and the table holds at most `capacity` keys (least recently used go).

Pure bookkeeping with an injected clock, like picker.py; the picker calls `choose` and
`remember`, the proxy computes `keys` from the request body.
"""

from __future__ import annotations

import json
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

from shoal.contract.routing import DEFAULT_IMBALANCE, PREFIX_AFFINITY, ROUTINGS

CHUNK_CHARS = 128
MAX_CHUNKS = 64  # keys cover at most the first 8,192 characters
IMBALANCE = DEFAULT_IMBALANCE
CAPACITY = 100_000
TTL_S = 600.0


def prompt_text(body: Any) -> str:
    """The text a request's prefix is taken from: a completion's prompt (the first one of a
    batch; token ids as numbers) or a chat's messages, role by role, in order."""
    if not isinstance(body, dict):
        return ""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = []
        for m in messages:
            if not isinstance(m, dict):
                continue
            content = m.get("content")
            if not isinstance(content, str):
                content = json.dumps(content, sort_keys=True, separators=(",", ":"))
            parts.append(f"<|{m.get('role')}|>{content}")
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: route by its first prompt
    if isinstance(prompt, list):
        return ",".join(str(t) for t in prompt) + ","
    return prompt if isinstance(prompt, str) else ""


class PrefixAffinity:
    def __init__(self, imbalance: int = IMBALANCE, *, chunk_chars: int = CHUNK_CHARS,
                 max_chunks: int = MAX_CHUNKS, capacity: int = CAPACITY, ttl: float = TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.imbalance = imbalance
        self.chunk_chars = chunk_chars
        self.max_chunks = max_chunks
        self.capacity = capacity
        self.ttl = ttl
        self.clock = clock
        # key -> (owner group key, when claimed); oldest first.
        self._table: OrderedDict[int, tuple[tuple[str, int], float]] = OrderedDict()
        self._held: Counter[tuple[str, int]] = Counter()  # owner -> keys in the table

    def keys(self, text: str) -> list[int]:
        """Chained hashes of the whole chunks of `text`, shortest prefix first."""
        out, h = [], 0
        n = min(len(text) // self.chunk_chars, self.max_chunks)
        for i in range(n):
            h = hash((h, text[i * self.chunk_chars:(i + 1) * self.chunk_chars]))
            out.append(h)
        return out

    def _owner(self, key: int, now: float) -> tuple[str, int] | None:
        entry = self._table.get(key)
        if entry is None or now - entry[1] > self.ttl:
            return None
        return entry[0]

    def choose(self, keys: list[int], candidates: list):
        """The candidate (a picker GroupState) that owns the longest known prefix of `keys`, if
        its load is within the bound; None lets the picker's own rule choose."""
        by_key = {s.group.key: s for s in candidates}
        least = min(s.outstanding for s in candidates)
        now = self.clock()
        for key in reversed(keys):
            owner = self._owner(key, now)
            if owner is None:
                continue
            state = by_key.get(owner)
            if state is None:
                continue  # its owner is gone or excluded: a shorter prefix may still have one
            if state.outstanding <= least + self.imbalance:
                return state
            # That home is busy: a shorter prefix's home (if another group) may take it.
        return None

    def remember(self, keys: list[int], chosen: tuple[str, int],
                 live: Iterable[tuple[str, int]]) -> None:
        """`chosen` served a prompt with these keys: it claims every key that has no live
        owner (or that it owns already, refreshing the claim)."""
        live = set(live)
        now = self.clock()
        for key in keys:
            owner = self._owner(key, now)
            if owner is None or owner == chosen or owner not in live:
                before = self._table.get(key)
                if before is not None:
                    self._held[before[0]] -= 1
                self._held[chosen] += 1
                self._table[key] = (chosen, now)
                self._table.move_to_end(key)
        while len(self._table) > self.capacity:
            _, (gone, _) = self._table.popitem(last=False)
            self._held[gone] -= 1

    def held(self, group: tuple[str, int]) -> int:
        """How many prefix keys the table gives `group` (expired claims too, until replaced or
        evicted): the size of the working set homed there."""
        return self._held.get(group, 0)

    def __len__(self) -> int:
        return len(self._table)


def make_affinity(routing: str, imbalance: int = IMBALANCE) -> PrefixAffinity | None:
    """The picker's affinity for a `routing` name; ValueError names the choices."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing {routing!r} is not one of {', '.join(ROUTINGS)}")
    return PrefixAffinity(imbalance) if routing == PREFIX_AFFINITY else None


def request_keys(affinity: PrefixAffinity | None, body: bytes) -> list[int] | None:
    """The prefix keys of a request body (JSON), or None when not routing by prefix."""
    if affinity is None:
        return None
    try:
        data = json.loads(body)
    except ValueError:
        return None
    return affinity.keys(prompt_text(data))
