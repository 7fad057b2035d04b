"""kv-aware scoring (kv_score.py): hits within the load bound, misses to the least loaded
(within one request, fewest claims first), random ties, stale groups by load only; the
prompt's token ids; the policy injected into the picker."""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import dataclass

import pytest
from shoal.router.discovery import Group
from shoal.router.engine_load import FRESH_S, EngineLoad, parse
from shoal.router.kv_index import KvIndex
from shoal.router.kv_score import (
    KvAware,
    PromptTokenizer,
    choose,
    claim_keys,
    load_encoder,
    load_of,
    prompt_ids,
    score,
)
from shoal.router.kv_wire import BlockStored, KVEventBatch
from shoal.router.picker import GroupPicker

G = [Group(i, f"http://g{i}:8000") for i in range(3)]
K = [g.key for g in G]


@dataclass
class State:
    group: Group
    outstanding: int
    engine: EngineLoad | None = None


def states(*loads):
    return [State(G[i], n) for i, n in enumerate(loads)]


NOW = 100.0


def engines(*gauges):
    """States whose engines report (running, waiting, kv usage), read at NOW; None: not read."""
    return [State(G[i], 0, None if g is None else EngineLoad(*g, at=NOW))
            for i, g in enumerate(gauges)]


@pytest.mark.parametrize("name, loads, cached, prompt, stale, expected", [
    ("the longest cached prefix wins at equal load", (0, 0, 0), {K[1]: 64, K[2]: 32}, 100,
     set(), {1}),
    ("a hit outweighs a little load", (2, 1, 0), {K[0]: 96}, 100, set(), {0}),
    ("a hit within the load bound (4) stays where it is cached, however small",
     (4, 0, 0), {K[0]: 16}, 100, set(), {0}),
    ("a hit past the load bound goes to the least loaded", (5, 0, 0), {K[0]: 96}, 100, set(),
     {1, 2}),
    ("past the bound, the best eligible hit wins", (9, 3, 0), {K[0]: 96, K[1]: 32}, 100, set(),
     {1}),
    ("equal hits: the fewer requests", (3, 1, 0), {K[0]: 64, K[1]: 64}, 100, set(), {1}),
    ("a miss goes to the least loaded, not to the smallest index", (3, 5, 1), {}, 100, set(),
     {2}),
    ("a miss with tied loads goes to either", (2, 2, 7), {}, 100, set(), {0, 1}),
    ("a stale group's entries are not trusted: scored by load", (0, 3, 3), {K[1]: 100}, 100,
     {K[1]}, {0}),
    ("a stale group can still win on load", (5, 0, 5), {K[0]: 100}, 100, {K[0]}, {1}),
    ("an unknown prompt (0 tokens) is a miss", (1, 0, 1), {}, 0, set(), {1}),
])
def test_choose(name, loads, cached, prompt, stale, expected):
    seen = {choose(states(*loads), cached, prompt, random.Random(seed), stale).group.id
            for seed in range(40)}
    assert seen == expected, name


@pytest.mark.parametrize("name, gauges, cached, expected", [
    ("another router's load on a group counts: a miss avoids it",
     ((6, 2, 0.5), (0, 0, 0.0), (1, 0, 0.1)), {}, {1}),
    ("the engine's queue outweighs a small hit", ((8, 8, 0.0), (0, 0, 0.0), (0, 0, 0.0)),
     {K[0]: 16}, {1, 2}),
    ("a full KV cache loses a tie of hits", ((1, 0, 1.0), (1, 0, 0.2), None), {K[0]: 64, K[1]: 64},
     {1}),
    ("a group whose gauges were not read competes by its outstanding count",
     ((3, 0, 0.0), None, (3, 0, 0.0)), {}, {1}),
])
def test_choose_with_the_engines_own_gauges(name, gauges, cached, expected):
    seen = {choose(engines(*gauges), cached, 100, random.Random(seed), now=NOW).group.id
            for seed in range(40)}
    assert seen == expected, name


def test_this_routers_own_requests_count_once():
    """requests(g) = outstanding(g) + others(g): the engine's gauges count this router's
    requests too, and those it tracks itself, to the moment. A request of ours that finished
    after the read leaves no load behind, one begun after it counts, and another router's
    requests still count."""
    done = State(G[0], 0, EngineLoad(1, 0, 0.0, at=NOW, ours=1))  # ours, finished since
    idle = State(G[1], 0, EngineLoad(0, 0, 0.0, at=NOW))
    assert {choose([done, idle], {}, 100, random.Random(s), now=NOW).group.id
            for s in range(40)} == {0, 1}  # a tie: both idle now
    started = State(G[0], 2, EngineLoad(1, 0, 0.0, at=NOW, ours=1))  # one more of ours since
    shared = State(G[1], 1, EngineLoad(3, 0, 0.0, at=NOW, ours=1))  # 2 of another router's
    assert load_of(started, NOW) == (2.0, 0.0)
    assert load_of(shared, NOW) == (3.0, 0.0)
    assert EngineLoad(1, 0, 0.0, at=NOW, ours=3).others == 0  # ours not yet at the engine


def test_ours_is_the_most_in_flight_during_the_read():
    """The prober's read of /metrics takes time; a request of ours that began and ended within
    it may be in the gauges (they are the last step's) and is not another router's."""
    import asyncio

    import httpx
    from shoal.router.engine_load import GAUGES
    from shoal.router.health import HealthProber
    from shoal.router.picker import GroupPicker

    picker = GroupPicker(kv=object())
    picker.set_groups(G[:1])
    gauges = "\n".join(f"{name} {v}" for name, v in zip(GAUGES, (1, 0, 0.1), strict=True))

    async def handle(request):
        if request.url.path == "/metrics":  # ours: sent, run, finished while this is read
            picker.acquire(G[0])
            picker.release(G[0])
            return httpx.Response(200, text=gauges)
        return httpx.Response(200, json={"data": []})

    async def read():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as client:
            await HealthProber(picker, client).read_engine(G[0])

    asyncio.run(read())
    engine = picker.states[G[0].key].engine
    assert (engine.running, engine.ours, engine.others) == (1, 1, 0)
    picker.acquire(G[0])  # a request begun after the read counts from its start
    assert load_of(picker.states[G[0].key], engine.at)[0] == 1


def test_old_gauges_are_not_used():
    busy = engines((9, 9, 1.0), (0, 0, 0.0))
    assert {choose(busy, {}, 100, random.Random(s), now=NOW + FRESH_S + 1).group.id
            for s in range(40)} == {0, 1}  # both read as idle: a tie


def test_the_engines_own_metrics_text_is_read():
    """The gauges as Shoal's engine renders them (its FrontendMetrics, vLLM's names)."""
    from shoal.engine.frontend.metrics import FrontendMetrics
    from shoal.engine.wire import SchedulerStats

    m = FrontendMetrics("tiny")
    m.record_step(SchedulerStats(num_running_reqs=3, num_waiting_reqs=2, kv_cache_usage=0.75),
                  now=1.0)
    assert parse(m.render().decode(), at=5.0) == EngineLoad(3, 2, 0.75, at=5.0)
    assert parse("# nothing here\nother_metric 1\n", at=5.0) is None


def test_the_gauges_alone_are_what_the_prober_reads():
    """The prober asks /metrics for engine_load.GAUGES alone (`name[]`): the engine's text of
    those names has the same load and no other series."""
    from shoal.engine.frontend.metrics import FrontendMetrics
    from shoal.engine.wire import SchedulerStats
    from shoal.router.engine_load import GAUGES

    m = FrontendMetrics("tiny")
    m.record_step(SchedulerStats(num_running_reqs=3, num_waiting_reqs=2, kv_cache_usage=0.75),
                  now=1.0)
    text = m.render(list(GAUGES)).decode()
    assert parse(text, at=5.0) == EngineLoad(3, 2, 0.75, at=5.0)
    samples = {line.split("{")[0] for line in text.splitlines() if not line.startswith("#")}
    assert samples == set(GAUGES)
    assert len(text) * 10 < len(m.render())


def test_ties_are_broken_at_random_with_the_injected_rng():
    picks = Counter(choose(states(0, 0, 0), {}, 10, random.Random(seed)).group.id
                    for seed in range(300))
    assert set(picks) == {0, 1, 2} and min(picks.values()) > 60
    a = [choose(states(0, 0, 0), {}, 10, rng).group.id for rng in [random.Random(7)] * 20]
    b = [choose(states(0, 0, 0), {}, 10, rng).group.id for rng in [random.Random(7)] * 20]
    assert a == b


def test_the_formula():
    assert score(50, 100) == pytest.approx(0.5)
    assert score(50, 100, kv_usage=0.8) == pytest.approx(0.5 - 0.25 * 0.8)
    assert score(0, 100) == 0.0
    assert score(10, 0) == 0.0
    assert choose([], {}, 10, random.Random(0)) is None


@pytest.fixture(scope="module")
def encode(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["[UNK]", "the", "cat", "sat", "on", "mat", "a", "dog"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return load_encoder(str(path.parent))


@pytest.mark.parametrize("body, expected", [
    ({"prompt": "the cat sat"}, [1, 2, 3]),
    ({"prompt": ["a dog", "the mat"]}, [6, 7]),  # a batch routes by its first prompt
    ({"prompt": [5, 6, 7]}, [5, 6, 7]),
    ({"prompt": [[1, 2], [3]]}, [1, 2]),
    ({"messages": [{"role": "user", "content": "the cat"}]}, []),  # no chat template here
    ({"prompt": [1, "x"]}, []),
    ({"prompt": None}, []),
])
def test_prompt_ids(encode, body, expected):
    assert prompt_ids(json.dumps(body).encode(), encode) == expected


def test_prompt_ids_of_a_non_json_body(encode):
    assert prompt_ids(b"not json", encode) == []


CHATS = [
    {"messages": [{"role": "system", "content": "You are terse."},
                  {"role": "user", "content": "Name three colours."}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "Part one."},
                                               {"type": "text", "text": "Part two."}]}]},
    {"messages": [{"role": "user", "content": "Go on."}], "add_generation_prompt": False},
    {"messages": [{"role": "user", "content": "Hi", "name": "ann"}],
     "chat_template_kwargs": {"enable_thinking": False}},
]


@pytest.mark.parametrize("body", CHATS)
def test_a_chat_is_tokenized_as_the_engines_frontend_does(tiny_model, body):
    from shoal.engine.tokenizer import FastTokenizer

    engine = FastTokenizer(tiny_model)
    messages = [{**m, "content": m["content"] if isinstance(m["content"], str)
                 else "\n".join(p["text"] for p in m["content"])} for m in body["messages"]]
    expected = engine.apply_chat_template(messages, body.get("add_generation_prompt", True),
                                          **body.get("chat_template_kwargs", {}))
    ours = prompt_ids(json.dumps(body).encode(), PromptTokenizer(tiny_model))
    assert ours == expected and len(ours) > 3


@pytest.mark.parametrize("extra", [
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
    {"reasoning_effort": "low"}, {"continue_final_message": True},
    {"add_special_tokens": True}, {"chat_template": "{{ messages }}"},
    {"messages": [{"role": "assistant", "content": None, "tool_calls": []}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
    {"messages": []},
])
def test_chats_the_router_cannot_render_exactly_are_misses(tiny_model, extra):
    body = {"messages": [{"role": "user", "content": "Hi"}], **extra}
    assert prompt_ids(json.dumps(body).encode(), PromptTokenizer(tiny_model)) == []


def test_the_engines_completion_tokens(tiny_model):
    from shoal.engine.tokenizer import FastTokenizer

    text = "Once upon a time, in a land far away"
    assert (prompt_ids(json.dumps({"prompt": text}).encode(), PromptTokenizer(tiny_model))
            == FastTokenizer(tiny_model)(text).input_ids)


def test_load_encoder_names_a_missing_tokenizer(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_encoder(str(tmp_path))


def _stored(hashes, tokens, parent=None):
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                       block_size=4, lora_id=None, medium="GPU", lora_name=None)


def test_the_picker_routes_a_cached_prefix_where_it_is_and_a_miss_by_load():
    index = KvIndex(stale_after=10.0)
    now = [100.0]
    aware = KvAware(index, None, rng=random.Random(1), clock=lambda: now[0])
    picker = GroupPicker(kv=aware, clock=lambda: now[0])
    picker.set_groups(G)
    prefix = list(range(32))
    index.apply(K[2], 0, KVEventBatch(1.0, [_stored([1, 2], prefix[:8])]), now[0])
    for _ in range(3):
        picker.acquire(G[0])  # group 0 busy, group 1 idle, group 2 holds the prefix
    picker.acquire(G[2])  # and has one request: 8/12 - 0.5 * 1/3 beats group 1's 0
    assert picker.pick(prefix=prefix[:12]) == G[2]
    assert picker.pick(prefix=list(range(500, 512))) == G[1]  # a miss: the least loaded
    assert picker.pick(prefix=None) == G[1]  # a chat (no token ids): by load
    # Group 2 got traffic and its events stopped: after 10 s it is scored by load only.
    now[0] += 11.0
    index.apply(K[1], 0, KVEventBatch(2.0, []), now[0])  # group 1's events do come
    index.refresh_stale(now[0])
    assert index.stale == {K[2]}
    assert picker.pick(prefix=prefix[:12]) == G[1]


def test_a_miss_goes_back_to_where_its_prefix_was_last_sent_within_the_load_bound():
    """No events yet (a burst), or the prefix evicted everywhere: the claim keeps a tenant on
    one group instead of scattering it by load; a home busier than the bound lets it spill."""
    index = KvIndex(stale_after=10.0)
    aware = KvAware(index, None, rng=random.Random(3), clock=lambda: 100.0)
    picker = GroupPicker(kv=aware, clock=lambda: 100.0)
    picker.set_groups(G)
    tenant = list(range(1000, 1048))  # three whole claim blocks
    picker.acquire(G[0]), picker.acquire(G[2])
    first = picker.pick(prefix=tenant + [1])
    assert first == G[1]  # a miss, nothing claimed: the least loaded
    for _ in range(3):
        picker.acquire(G[1])  # its home is now the busiest (3 against 1), within the bound 4
    assert picker.pick(prefix=tenant + [2]) == G[1]
    assert picker.pick(prefix=tenant[:16] + [7] * 40) == G[1], "a shorter claimed prefix"
    for _ in range(3):
        picker.acquire(G[1])  # 6 against 1: past the bound, it spills to the least loaded
    assert picker.pick(prefix=tenant + [3]) in (G[0], G[2])
    # The engines' events outrank a claim: group 2 reports the tenant's blocks cached.
    index.apply(K[2], 0, KVEventBatch(1.0, [_stored([1, 2, 3], tenant[:12])]), 100.0)
    assert picker.pick(prefix=tenant + [4]) == G[2]


def test_claims_cover_whole_blocks_only():
    assert claim_keys(list(range(15))) == []
    a, b = claim_keys(list(range(40))), claim_keys(list(range(32)) + [9] * 8)
    assert len(a) == 2 and a == b, "the partial third block does not count"
    assert claim_keys([5] * 16 + list(range(16)))[0] == claim_keys([5] * 16)[0]
    assert len(claim_keys(list(range(10 ** 5)))) == 256


# ----- long prompts: tokenized in growing pieces (progressive_keys) ------------------------

PROSE = ("The quarterly report covers invoices, refunds and payment plans for every region; "
         "each section lists the figures, the caveats and the people to ask. ")
CODE = "def handler(event):\n    if event:\n        return  {'ok': True}\n\n\n    # done\t\t\n"
MIXED = "Résumé naïve café — 東京の天気は晴れです。 Ünïcödé  spaces   and\ttabs\n"


def _trained(kind: str, tmp_path) -> str:
    """A real tokenizer of another family than the project's byte-level BPE, trained here with
    `tokenizers`: Metaspace BPE (Llama 2 / SentencePiece style) or Unigram."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    if kind == "metaspace-bpe":
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>"])
    else:
        tok = Tokenizer(models.Unigram())
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        trainer = trainers.UnigramTrainer(vocab_size=400, unk_token="<unk>",
                                          special_tokens=["<unk>"])
    tok.train_from_iterator([PROSE * 20, CODE * 20, MIXED * 20], trainer)
    folder = tmp_path / kind
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    return str(folder)


@pytest.fixture(params=["project-bytelevel-bpe", "metaspace-bpe", "unigram"])
def long_tokenizer(request, tiny_model, tmp_path):
    if request.param == "project-bytelevel-bpe":
        return PromptTokenizer(tiny_model)
    return PromptTokenizer(_trained(request.param, tmp_path))


class Counting:
    """A PromptTokenizer that counts the characters it was asked to encode."""

    def __init__(self, tok) -> None:
        self.tok, self.chars = tok, 0

    def encode(self, text, add_special_tokens=True):
        self.chars += len(text)
        return self.tok.encode(text, add_special_tokens)

    def encode_with_ends(self, text, add_special_tokens=True):
        self.chars += len(text)
        return self.tok.encode_with_ends(text, add_special_tokens)


@pytest.mark.parametrize("unit", [PROSE, CODE, MIXED])
def test_a_fully_cached_long_prompt_is_tokenized_whole_and_exactly(long_tokenizer, unit):
    from shoal.router.kv_score import Prompt, progressive_keys

    text = (unit * (200_000 // len(unit) + 1))[:200_000]
    full = long_tokenizer.encode(text)
    keys = progressive_keys(Prompt(text=text), long_tokenizer, reach=len)
    assert keys.ids == full and keys.total == len(full)


@pytest.mark.parametrize("unit", [PROSE, CODE, MIXED])
def test_a_miss_costs_the_first_piece_and_its_ids_are_the_prompts_own(long_tokenizer, unit):
    from shoal.router.kv_score import FIRST_CHARS, Prompt, progressive_keys

    text = (unit * (200_000 // len(unit) + 1))[:200_000]
    full = long_tokenizer.encode(text)
    counting = Counting(long_tokenizer)
    keys = progressive_keys(Prompt(text=text), counting, reach=lambda ids: 0)
    assert counting.chars == FIRST_CHARS
    assert keys.ids and keys.ids == full[:len(keys.ids)]
    assert abs(keys.total - len(full)) / len(full) < 0.1  # the estimated length


def test_a_partly_cached_long_prompt_stops_where_the_cache_ends(long_tokenizer):
    from shoal.router.kv_score import Prompt, progressive_keys

    text = (PROSE * 1500)[:200_000]
    full = long_tokenizer.encode(text)
    # tokens: past the first piece, short of the second
    cached = len(long_tokenizer.encode(text[:16384])) * 3 // 2
    counting = Counting(long_tokenizer)
    keys = progressive_keys(Prompt(text=text), counting,
                            reach=lambda ids: min(len(ids) // 16 * 16, cached))
    assert counting.chars == 16384 + 4 * 16384
    assert len(keys.ids) > cached and keys.ids == full[:len(keys.ids)]


def test_token_id_prompts_are_taken_as_they_are(long_tokenizer):
    from shoal.router.kv_score import Prompt, progressive_keys

    counting = Counting(long_tokenizer)
    keys = progressive_keys(Prompt(ids=list(range(50_000))), counting, reach=len)
    assert keys.ids == list(range(50_000)) and keys.total == 50_000 and counting.chars == 0


def test_a_miss_between_equally_loaded_groups_goes_to_the_one_holding_fewest_claims():
    held = {K[0]: 5, K[1]: 0, K[2]: 5}.get
    assert {choose(states(0, 0, 0), {}, 100, random.Random(s), held=held).group.id
            for s in range(50)} == {1}
    # Load first: only the groups at most one request above the least compete on claims.
    assert {choose(states(2, 0, 0), {}, 100, random.Random(s), held={K[0]: 0, K[1]: 9,
                                                                   K[2]: 3}.get).group.id
            for s in range(50)} == {2}
    # One request in flight is not load enough to home a new prefix elsewhere.
    assert {choose(states(1, 0, 0), {}, 100, random.Random(s), held={K[0]: 0, K[1]: 9,
                                                                   K[2]: 3}.get).group.id
            for s in range(50)} == {0}
    # Equal claims within the slack: the fewer requests.
    assert {choose(states(1, 0, 1), {}, 100, random.Random(s), held=lambda k: 2).group.id
            for s in range(50)} == {1}
    # Equal claims: at random among them.
    assert {choose(states(0, 0, 0), {}, 100, random.Random(s), held=lambda k: 2).group.id
            for s in range(50)} == {0, 1, 2}


def test_misses_do_not_pile_onto_the_group_holding_fewest_claims():
    """sglang #32983's shape: one group's index is empty (it just joined) and every request is
    a new prefix. It takes misses only while at most one request busier than the least
    loaded; then the others do, so no group gets more than two requests ahead."""
    aware = KvAware(KvIndex(stale_after=10.0), None, rng=random.Random(5), clock=lambda: 100.0)
    picker = GroupPicker(kv=aware, clock=lambda: 100.0)
    picker.set_groups(G)
    for g in (G[0], G[1]):  # groups 0 and 1 already home many prefixes; group 2 none
        for i in range(20):
            aware.claims.remember(claim_keys(list(range(10_000 * (g.id + 1) + 64 * i,
                                                        10_000 * (g.id + 1) + 64 * i + 64))),
                                  g.key, [g.key])
    homes = Counter()
    for i in range(30):  # unique prompts, none answered yet: every one stays in flight
        chosen = picker.pick(prefix=list(range(100_000 + 64 * i, 100_000 + 64 * i + 64)))
        picker.acquire(chosen)
        homes[chosen.id] += 1
        counts = sorted(picker.states[k].outstanding for k in K)
        assert counts[-1] - counts[0] <= 2, (i, counts)
    assert homes[2] <= 12 and homes[0] >= 9 and homes[1] >= 9, homes


def test_new_tenants_at_idle_groups_are_homed_evenly():
    """Six tenants arriving one after another while every group is idle: two per group (at
    random, one group was seen to get 1 tenant of 12 and another 6)."""
    for seed in range(10):
        aware = KvAware(KvIndex(stale_after=10.0), None, rng=random.Random(seed),
                        clock=lambda: 100.0)
        picker = GroupPicker(kv=aware, clock=lambda: 100.0)
        picker.set_groups(G)
        homes = Counter()
        for t in range(6):
            tenant = list(range(1000 * (t + 1), 1000 * (t + 1) + 48))
            homes[picker.pick(prefix=tenant + [1])] += 1
            assert picker.pick(prefix=tenant + [2]) == picker.pick(prefix=tenant + [3])
        assert sorted(homes.values()) == [2, 2, 2], (seed, homes)
