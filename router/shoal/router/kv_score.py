"""`routing: kv-aware`: send a request to the group whose KV cache already holds most of its
prompt (kv_index.py, fed by the engines' KV events), weighed against load.

Which candidate (usable, ready) group g gets a prompt of P tokens:

    requests(g) = outstanding(g) + others(g)
    eligible    = the g with requests(g) <= min over candidates of requests + B
    score(g)    = cached(g) / P - beta * kv(g)          for g eligible
    winner      = the eligible g of highest score; ties: fewest requests(g), then at random

cached(g) is the index's longest cached prefix on g, in tokens; 0 for a stale group (its
publisher unreachable, or silent despite traffic: kv_index.why_stale; its entries are not
trusted, it competes by load only). outstanding(g) is this router's requests in flight on g,
to the moment; others(g) those of other routers (frontend replicas, the gateway): the engine's
own running + waiting gauges less the most requests this router had in flight on g while it
read them, at least 0 (engine_load.EngineLoad.others: alone in front of its engines a router
sees none); kv (KV cache usage, 0..1) is the engine's gauge too. The gauges are read by the
health prober every probe round and left out (0) when older than engine_load.FRESH_S.
(max(outstanding, running + waiting), the first form, kept a request of ours that had finished
since the read as load for up to a probe round.) B = DEFAULT_IMBALANCE (4, prefix-affinity's
load bound): load
moves a hit only past the bound, so a tenant stays where its context is cached while that group
is at most 4 requests busier than the least loaded (a load term weighed against every hit, the
first formula, moved a quarter of the hits off their home at 16 req/s: benchmarks/README.md).
beta = BETA (0.25): a full KV cache (preemption ahead) gives up a quarter of a prompt's hit.
A miss (no candidate caches any of the prompt, or a prompt the router cannot tokenize exactly)
goes to the group that this router last sent the prompt's longest claimed prefix
(CLAIM_TOKENS-token blocks of its ids), if that group's outstanding requests exceed the least
loaded's by at most B (affinity.PrefixAffinity's claims and bound); else to a least-loaded
candidate, never to whichever has the smallest index. Least loaded, for a miss: requests(g) at
most MISS_SLACK (1) above the least; among those, the one holding the fewest claims (the
prefixes homed there: its working set), then the fewest requests(g), then at random. A new
prefix is placed once and stays (its claim), so where it goes decides which cache holds it from
then on: by load alone, placement followed whichever group was idle at that instant (one request
apart at 8 req/s), and homed 5, 4 and 3 tenants of 12 (49% hit rate against the oracle's 57%,
2026-12-07); at random among idle groups, 1 and 6. One request of slack cannot pile misses onto
a group (sglang #32983): a group two requests busier than the least takes none (tested). Claims are
made when a request is routed, before its events can arrive: a burst of one tenant's prompts
stays together, and a tenant whose blocks were evicted everywhere goes back to its last group
instead of scattering (measured: benchmarks/README.md, kv-routing).

Tokenizing (PromptTokenizer): the model's tokenizer.json through `tokenizers` (no torch), as the
engine does: a completion's text prompt with its special tokens, a token-id prompt as given, the
first prompt of a batch; a chat rendered with the model's chat template (sandboxed Jinja, as the
engine's frontend) and encoded without special tokens. A long text prompt is tokenized in
growing leading pieces while it hits (progressive_keys): a miss costs its first piece. What
the router cannot reproduce exactly (tools, non-text content parts, tool-call messages,
reasoning_effort, continue_final_message, a request's own chat_template) routes as a miss, by
load.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from shoal.contract.routing import DEFAULT_IMBALANCE
from shoal.router.affinity import PrefixAffinity
from shoal.router.engine_load import fresh
from shoal.router.kv_index import KvIndex

BETA = 0.25
THREAD_ABOVE = 8192  # body bytes above which tokenizing leaves the event loop
FIRST_CHARS = 16384  # a long prompt's first piece to tokenize (progressive_keys)
MARGIN_CHARS = 256  # a piece's tail whose tokens are not trusted
MAX_BLOCK_TOKENS = 64  # "cached to the end" allows a last partial block this long
CLAIM_TOKENS = 16  # a claim covers whole blocks of this many token ids
MAX_CLAIMS = 256  # claims cover at most the first 4,096 tokens
MISS_SLACK = 1  # a miss's least-loaded candidates: at most this many requests above the least
WORD_CACHE = 1000  # words the tokenizer model keeps split (`tokenizers`' default: 10,000)


def claim_keys(ids: list[int]) -> list[int]:
    """Chained hashes of the whole CLAIM_TOKENS blocks of `ids`, shortest prefix first."""
    out, h = [], 0
    for i in range(min(len(ids) // CLAIM_TOKENS, MAX_CLAIMS)):
        h = hash((h, tuple(ids[i * CLAIM_TOKENS:(i + 1) * CLAIM_TOKENS])))
        out.append(h)
    return out


def score(cached: int, prompt_tokens: int, kv_usage: float = 0.0, beta: float = BETA) -> float:
    """The formula above, for one eligible group."""
    hit = cached / prompt_tokens if prompt_tokens else 0.0
    return hit - beta * kv_usage


def load_of(state, now: float) -> tuple[float, float]:
    """(requests(g), kv(g)) of a candidate (`.outstanding`, `.engine`: an EngineLoad or None)."""
    engine = fresh(state.engine, now)
    if engine is None:
        return float(state.outstanding), 0.0
    return state.outstanding + engine.others, engine.kv_usage


def choose(candidates: list, cached: dict, prompt_tokens: int, rng: random.Random,
           stale: set = frozenset(), imbalance: int = DEFAULT_IMBALANCE, now: float = 0.0,
           home=None, held: Callable[[tuple[str, int]], int] | None = None):
    """The candidate (anything with `.group.key`, `.outstanding` and `.engine`, e.g. a picker
    GroupState) to route to; None only when there are no candidates. `home`: the candidate a
    miss goes to (the claim's owner within the load bound), None for the least loaded;
    `held(key)`: the claims a group holds, which places a miss among the least-loaded groups
    (None: the fewest requests, then at random)."""
    if not candidates:
        return None
    loads = {s.group.key: load_of(s, now) for s in candidates}
    least = min(r for r, _ in loads.values())
    eligible = [s for s in candidates if loads[s.group.key][0] <= least + imbalance]
    hits = {s.group.key: (0 if s.group.key in stale else cached.get(s.group.key, 0))
            for s in eligible}
    if not any(hits.values()):  # a miss: its claimed home, else the least loaded
        if home is not None:
            return home
        pool = [s for s in candidates if loads[s.group.key][0] <= least + MISS_SLACK]
        if held is not None and len(pool) > 1:
            fewest = min(held(s.group.key) for s in pool)
            pool = [s for s in pool if held(s.group.key) == fewest]
        low = min(loads[s.group.key][0] for s in pool)
        return rng.choice([s for s in pool if loads[s.group.key][0] == low])
    ranks = {k: (score(hits[k], prompt_tokens, loads[k][1]), -loads[k][0]) for k in hits}
    best = max(ranks.values())
    return rng.choice([s for s in eligible if ranks[s.group.key] == best])


CHAT_REFUSED = ("tools", "reasoning_effort", "continue_final_message", "add_special_tokens",
                "chat_template")  # they change the engine's rendering: not reproduced here


def _plain_messages(messages) -> list[dict] | None:
    """The messages as the engine's template gets them, when they are plain (a role, text
    content as a string or text parts, an optional name); None otherwise."""
    if not isinstance(messages, list) or not messages:
        return None
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return None
        if set(m) - {"role", "content", "name"}:
            return None
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                return None
            content = "\n".join(p["text"] for p in content)  # as vLLM joins text parts
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            return None
        msg = {"role": m["role"], "content": content}
        if m.get("name") is not None:
            msg["name"] = m["name"]
        out.append(msg)
    return out


@dataclass(frozen=True)
class Prompt:
    """What the engine will tokenize: `ids` as given, or `text` (with or without the special
    tokens)."""

    ids: list[int] | None = None
    text: str | None = None
    special: bool = True


def prompt_of(body: bytes, tok) -> Prompt | None:
    """The request's prompt as the engine will see it; None when the router cannot know it
    exactly (an unparseable body, a chat with tools or non-text parts, ...). `tok`: a
    PromptTokenizer (or anything with its render_chat)."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    if "messages" in data:
        messages = _plain_messages(data["messages"])
        if messages is None or any(data.get(k) for k in CHAT_REFUSED):
            return None
        kwargs = data.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            return None
        text = tok.render_chat(messages, data.get("add_generation_prompt", True) is not False,
                               kwargs)
        return None if text is None else Prompt(text=text, special=False)
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return Prompt(text=prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return Prompt(ids=prompt)
    return None


def prompt_ids(body: bytes, tok) -> list[int]:
    """The token ids the engine will see for the request's prompt, all of them; [] when the
    router cannot know them exactly."""
    p = prompt_of(body, tok)
    if p is None:
        return []
    return p.ids if p.ids is not None else tok.encode(p.text, add_special_tokens=p.special)


@dataclass(frozen=True)
class PromptKeys:
    """The prompt's leading token ids the router looked up (`ids`) and its length in tokens
    (`total`: exact when `ids` is all of it, else estimated from the characters left)."""

    ids: list[int]
    total: int


def progressive_keys(prompt: Prompt, tok, reach) -> PromptKeys:
    """Tokenize a long text prompt in growing leading pieces (FIRST_CHARS, then x4 each time),
    only while some group caches all of what was tokenized so far (`reach(ids)`: the longest
    cached prefix on any group, in tokens): a miss on a 200 KB prompt costs its first 16 KB, not
    all of it. A piece's last MARGIN_CHARS are not trusted (a tokenizer's pre-tokenizer may
    split the cut differently from the whole text), so its tokens are those ending before."""
    if prompt.ids is not None:
        return PromptKeys(prompt.ids, len(prompt.ids))
    text, n = prompt.text, FIRST_CHARS
    while True:
        if n >= len(text):
            ids = tok.encode(text, add_special_tokens=prompt.special)
            return PromptKeys(ids, len(ids))
        ids, ends = tok.encode_with_ends(text[:n], add_special_tokens=prompt.special)
        keep = bisect.bisect_right(ends, n - MARGIN_CHARS)
        ids = ids[:keep]
        if reach(ids) < len(ids) - MAX_BLOCK_TOKENS or not ids:
            return PromptKeys(ids, max(len(ids), round(len(ids) * len(text) / max(1, n))))
        n *= 4


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


class PromptTokenizer:
    """The model's tokenizer.json (`tokenizers`) and chat template (tokenizer_config.json's
    `chat_template` or chat_template.jinja), rendered as the engine's frontend renders it: a
    sandboxed Jinja environment with trim_blocks/lstrip_blocks, then encoded without special
    tokens (shoal.engine.tokenizer.FastTokenizer; transformers' fast tokenizers)."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer

        root = Path(path)
        if root.is_file():
            root = root.parent
        if not (root / "tokenizer.json").is_file():
            raise ValueError("kv-aware routing needs the model's tokenizer.json: "
                             f"{root / 'tokenizer.json'} is not a file")
        self._tok = Tokenizer.from_file(str(root / "tokenizer.json"))
        bound_word_cache(self._tok)
        config: dict = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):
            if (root / name).is_file():
                config.update(json.loads((root / name).read_text()))
        self.bos_token = _token_text(config.get("bos_token")) or ""
        self.eos_token = _token_text(config.get("eos_token")) or ""
        source = config.get("chat_template")
        if source is None and (root / "chat_template.jinja").is_file():
            source = (root / "chat_template.jinja").read_text()
        self._template = None
        if isinstance(source, str):
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            self._template = env.from_string(source)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_with_ends(self, text: str, add_special_tokens: bool = True):
        """(ids, the character offset where each token ends): special tokens end at 0."""
        enc = self._tok.encode(text, add_special_tokens=add_special_tokens)
        ends, last = [], 0
        for _, end in enc.offsets:
            last = max(last, end)
            ends.append(last)
        return enc.ids, ends

    def render_chat(self, messages: list[dict], add_generation_prompt: bool,
                    kwargs: dict) -> str | None:
        """The chat's prompt text; None without a template or when it refuses the chat."""
        if self._template is None:
            return None
        try:
            return self._template.render({
                **{k: v for k, v in kwargs.items() if k not in ("messages", "tools")},
                "messages": messages, "add_generation_prompt": add_generation_prompt,
                "bos_token": self.bos_token, "eos_token": self.eos_token, "tools": None})
        except Exception:  # noqa: BLE001 - the engine answers it (a 400); routing by load
            return None


def bound_word_cache(tok) -> None:
    """Cap the word cache of a `tokenizers` BPE model at WORD_CACHE words. It keeps
    every new word's pieces, never evicting, until it holds 10,000: unique prompts (serial
    numbers, ids, random text) fill it, and the gateway's RSS rose for the first 18 minutes of
    benchmarks/router_overhead.py (a loop of the gateway's kv-aware work: +13 MiB over 16,000
    unique 100-220 KB prompts with the default, +0.2 MiB capped; benchmarks/README.md). The
    first WORD_CACHE words seen stay cached, which holds a language's common words. A model
    without the (underscored) resize method keeps its own."""
    resize = getattr(tok.model, "_resize_cache", None)
    if resize is not None:
        resize(WORD_CACHE)


def _raise(message):
    raise ValueError(message)


def load_encoder(path: str) -> PromptTokenizer:
    """The PromptTokenizer of a model folder (or its tokenizer.json), or of `hf://ORG/NAME@REV`
    in the huggingface_hub cache at $HF_HUB_CACHE that `shoal fetch --files tokenizer` filled
    (a kv-aware frontend pod's init container); ValueError names what is missing."""
    if path.startswith("hf://"):
        from shoal.contract.model_fetch import CACHE_DIR, cached_snapshot, parse_hf

        try:
            path = cached_snapshot(os.environ.get("HF_HUB_CACHE") or CACHE_DIR, parse_hf(path))
        except FileNotFoundError as exc:
            raise ValueError(f"kv-aware routing needs the model's tokenizer: {exc}") from None
    return PromptTokenizer(path)


class KvAware:
    """The picker's injected policy (the interface of affinity.PrefixAffinity): `keys` are the
    prompt's token ids, `choose` scores the candidates, `remember` notes the traffic that makes
    a silent group stale."""

    def __init__(self, index: KvIndex, tokenizer, *,
                 imbalance: int = DEFAULT_IMBALANCE, rng: random.Random | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        import time

        self.index = index
        self.tokenizer = tokenizer  # a PromptTokenizer
        self.imbalance = imbalance
        self.rng = rng or random.Random()
        self.clock = clock or time.monotonic
        self.claims = PrefixAffinity(imbalance, clock=self.clock)  # where each prefix was last sent

    def request_keys(self, body: bytes) -> PromptKeys:
        prompt = prompt_of(body, self.tokenizer)
        if prompt is None:
            return PromptKeys([], 0)
        return progressive_keys(prompt, self.tokenizer, self._reach)

    def _reach(self, ids: list[int]) -> int:
        return max(self.index.longest_prefix(ids).values(), default=0)

    async def keys_of(self, body: bytes) -> PromptKeys:
        """request_keys off the event loop for a large body (tokenizing 16 KB takes a few
        milliseconds, 200 KB a hundred: other requests must not wait for it)."""
        if len(body) < THREAD_ABOVE:
            return self.request_keys(body)
        return await asyncio.to_thread(self.request_keys, body)

    def choose(self, keys: PromptKeys | list[int], candidates: list):
        if not isinstance(keys, PromptKeys):
            keys = PromptKeys(list(keys), len(keys))
        cached = self.index.longest_prefix(keys.ids)
        claimed = claim_keys(keys.ids)
        home = self.claims.choose(claimed, candidates) if claimed else None
        return choose(candidates, cached, keys.total, self.rng, self.index.stale,
                      self.imbalance, self.clock(), home=home, held=self.claims.held)

    def remember(self, keys, chosen, live) -> None:
        """`chosen` was sent this prompt: it claims the prompt's blocks that have no live
        owner (affinity's rule), and its traffic is noted (a silent group goes stale)."""
        ids = keys.ids if isinstance(keys, PromptKeys) else list(keys)
        if ids:
            self.claims.remember(claim_keys(ids), chosen, live)
        self.index.note_traffic(chosen, self.clock())
