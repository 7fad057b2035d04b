"""`routing: kv-aware`: send a request to the group whose KV cache already holds most of its
prompt (kv_index.py, fed by the engines' KV events), weighed against load.

Score of each candidate (usable, ready) group g for a prompt of P tokens:

    score(g) = cached(g) / P - alpha * load(g)
    load(g)  = outstanding(g) / max(1, the most outstanding among the candidates)

cached(g) is the index's longest cached prefix on g, in tokens; 0 for a stale group (its
events stopped while it had traffic: its entries are not trusted, it competes by load only).
alpha = ALPHA (0.5): a group whose load is the highest gives up half a prompt's worth of hit.
The highest score wins; ties are broken at random (an injectable RNG). A miss (no candidate
caches any of the prompt, or a prompt the router cannot tokenize exactly) goes to the least
loaded candidate, ties at random: never to whichever has the smallest index.

Tokenizing: the model's tokenizer.json through `tokenizers` (no torch), as the engine does a
completion: a text prompt with its special tokens, a token-id prompt as given, the first prompt
of a batch. Chat requests are not tokenized yet (the engine renders the chat template first;
matching it needs the template in the router): they route as a miss, by load.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable
from pathlib import Path

from shoal.router.kv_index import KvIndex

ALPHA = 0.5
THREAD_ABOVE = 8192  # body bytes above which tokenizing leaves the event loop


def score(cached: int, prompt_tokens: int, outstanding: int, most_outstanding: int,
          alpha: float = ALPHA) -> float:
    """The formula above, for one group."""
    hit = cached / prompt_tokens if prompt_tokens else 0.0
    return hit - alpha * outstanding / max(1, most_outstanding)


def choose(candidates: list, cached: dict, prompt_tokens: int, rng: random.Random,
           stale: set = frozenset(), alpha: float = ALPHA):
    """The candidate (anything with `.group.key` and `.outstanding`, e.g. a picker GroupState)
    to route to; None only when there are no candidates."""
    if not candidates:
        return None
    most = max(s.outstanding for s in candidates)
    hits = {s.group.key: (0 if s.group.key in stale else cached.get(s.group.key, 0))
            for s in candidates}
    if not any(hits.values()):  # a miss: the least loaded
        least = min(s.outstanding for s in candidates)
        return rng.choice([s for s in candidates if s.outstanding == least])
    scores = {s.group.key: score(hits[s.group.key], prompt_tokens, s.outstanding, most, alpha)
              for s in candidates}
    best = max(scores.values())
    return rng.choice([s for s in candidates if scores[s.group.key] == best])


def prompt_ids(body: bytes, encode: Callable[[str], list[int]]) -> list[int]:
    """The token ids the engine will see for a completion's prompt; [] when not exactly known
    (a chat, an unparseable body)."""
    try:
        data = json.loads(body)
    except ValueError:
        return []
    if not isinstance(data, dict) or "messages" in data:
        return []
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return encode(prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return prompt
    return []


def load_encoder(path: str) -> Callable[[str], list[int]]:
    """encode(text) -> ids with the model's tokenizer.json (`path`: the file or its folder)."""
    from tokenizers import Tokenizer

    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise ValueError(f"kv-aware routing needs the model's tokenizer.json: {p} is not a file")
    tok = Tokenizer.from_file(str(p))
    return lambda text: tok.encode(text, add_special_tokens=True).ids


class KvAware:
    """The picker's injected policy (the interface of affinity.PrefixAffinity): `keys` are the
    prompt's token ids, `choose` scores the candidates, `remember` notes the traffic that makes
    a silent group stale."""

    def __init__(self, index: KvIndex, encode: Callable[[str], list[int]], *,
                 alpha: float = ALPHA, rng: random.Random | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        import time

        self.index = index
        self.encode = encode
        self.alpha = alpha
        self.rng = rng or random.Random()
        self.clock = clock or time.monotonic

    def request_keys(self, body: bytes) -> list[int]:
        return prompt_ids(body, self.encode)

    async def keys_of(self, body: bytes) -> list[int]:
        """request_keys off the event loop for a large body (a 200 KB prompt takes tens of
        milliseconds to tokenize: other requests must not wait for it)."""
        if len(body) < THREAD_ABOVE:
            return self.request_keys(body)
        return await asyncio.to_thread(self.request_keys, body)

    def choose(self, keys: list[int], candidates: list):
        cached = self.index.longest_prefix(keys)
        return choose(candidates, cached, len(keys), self.rng, self.index.stale, self.alpha)

    def remember(self, keys: list[int], chosen, live) -> None:
        self.index.note_traffic(chosen, self.clock())
