"""kv-aware routing side by side: Shoal's router (least-outstanding, prefix-affinity, kv-aware)
and the real peer routers from the package index (vllm-router 0.1.17 kv_aware and cache_aware,
sglang-router 0.3.2 cache_aware) in front of the same `shoal serve` groups on loopback.

Workload, shaped like llm-d's multi-tenant shared-prefix benchmark and scaled to this machine:
`--tenants` tenants, each a long shared context (`--context-chars` of text), `--users` users
per tenant, each asking `--turns` short questions of their own (`--query-chars`); every
request is a streamed `/v1/completions` of context + question with `--max-tokens` output tokens
(ignore_eos), in a seeded shuffled order, sent open loop at `--rates` requests/s (Poisson
arrivals: a slow router is not given time back). Completions, as in the tables so far (since
Shoal's /tokenize takes vllm-router's `continue_final_message: false`, chats route by their
cached prefix there too: tests/router/test_kv_peer_routers.py).

Every (policy, rate) cell starts `--groups` fresh `shoal serve` groups (empty caches; KV events
on, the same for every policy) of `--kv` KV cache each, sized so that the tenants' contexts are
about 1.5x what all groups together can hold (eviction happens: the engines' BlockRemoved
events are counted), and a fresh router; warms the processes with a few requests of other
tenants, then measures:

- prefix-cache hit rate: the groups' own `vllm:prefix_cache_hits` / `..._queries` (tokens);
- TTFT p50/p90 (client side: request sent -> first streamed text), output tokens/s (the groups'
  `vllm:generation_tokens` over the run's wall time), errors;
- load spread: requests per group (each group's `vllm:request_success`), and max/min;
- blocks the engines evicted (BlockRemoved in their KV event streams).

The ceiling line is the hit rate with an unbounded cache on one engine: every request but each
tenant's first reuses its context's full blocks.

    PYTHONPATH=tests .venv/bin/python benchmarks/kv_routing.py

It prints the machine's CPU flags and one table (benchmarks/README.md has the figures).
`--router-restart` instead SIGKILLs kv-aware's router halfway through the workload and starts it
again: seconds until it serves, until its index holds the engines' blocks again (replay
snapshots), and the hit rate before the kill, in the first 2 s after and later, beside the
same windows of the same run (seed) left undisturbed: the hit rate a restart is measured against.
`--repeats N` runs each cell (or restart) on N workload seeds. After the table, each policy's
TTFT p90 is set against kv-aware's with a 90% bootstrap interval (whether a gap of a few
milliseconds is more than the noise of the pooled requests) and seed by seed (runs of one seed
share tenants, order and arrivals; at 16 req/s a policy's p90 moved more from seed to seed than
the pooled interval showed), with the mean of those seed gaps and a t-interval over the seeds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import msgspec
import zmq
from prefix_routing import (
    MODELS,
    WORDS,
    cpu_flags,
    metric_sum,
    metric_total,
    pct,
    wait_healthy,
    wait_usable,
)
from support.net import free_ports
from support.peer_routers import KvSource, ensure_peer_routers, sglang_router, vllm_router

POLICIES = ("least-outstanding", "prefix-affinity", "kv-aware", "vllm-router:kv_aware",
            "vllm-router:cache_aware", "sglang-router:cache_aware")
MODEL = "m"


class EvictionCounter:
    """Counts the blocks one engine reports stored and removed on its KV event stream."""

    def __init__(self, endpoint: str) -> None:
        self.stored = self.removed = 0
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sub.poll(100):
                continue
            _topic, _seq, payload = self._sub.recv_multipart()
            _ts, events, *_ = msgspec.msgpack.decode(payload)
            for ev in events:
                if ev.get("type") == "BlockStored":
                    self.stored += len(ev["block_hashes"])
                elif ev.get("type") == "BlockRemoved":
                    self.removed += len(ev["block_hashes"])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sub.close(linger=0)
        self._ctx.term()


class Fleet:
    """`groups` fresh `shoal serve` processes publishing KV events, and one router over them."""

    def __init__(self, args, policy: str, tmp: Path) -> None:
        self.procs: list[subprocess.Popen] = []
        self.peer = None
        self.urls: list[str] = []
        self.kv: dict[str, KvSource] = {}
        self.counters: list[EvictionCounter] = []
        try:
            self._start(args, policy, tmp)
        except BaseException:  # a group or the router failed to start: stop what did start
            self.stop()
            raise

    def _start(self, args, policy: str, tmp: Path) -> None:
        model_dir = str(MODELS / f"shoal-{args.model}")
        py = sys.executable
        for _ in range(args.groups):
            port, ev, rp = free_ports(3)
            url = f"http://127.0.0.1:{port}"
            cfg = {"enable_kv_cache_events": True, "publisher": "zmq",
                   "endpoint": f"tcp://*:{ev}", "replay_endpoint": f"tcp://*:{rp}"}
            cmd = [py, "-m", "shoal.cli", "serve", model_dir, "--host", "127.0.0.1",
                   "--port", str(port), "--served-model-name", MODEL,
                   "--kv-cache-memory-bytes", args.kv, "--num-threads", str(args.threads),
                   "--max-model-len", str(args.max_model_len),
                   "--kv-events-config", json.dumps(cfg), "--enable-prompt-tokens-details"]
            self.procs.append(subprocess.Popen(cmd, start_new_session=True,
                                               stdout=subprocess.DEVNULL,
                                               stderr=open(tmp / f"serve-{port}.log", "w")))
            self.urls.append(url)
            self.kv[url] = KvSource(f"tcp://127.0.0.1:{ev}", f"tcp://127.0.0.1:{rp}")
        for url, proc in zip(self.urls, self.procs, strict=True):
            wait_healthy(url, proc)
        self.kv_tokens = sum(kv_tokens(u) for u in self.urls)
        self.counters = [EvictionCounter(self.kv[u].events) for u in self.urls]
        self.url = self._start_router(args, policy, model_dir, tmp)

    def _start_router(self, args, policy: str, model_dir: str, tmp: Path) -> str:
        if ":" in policy:
            name, peer_policy = policy.split(":")
            if name == "vllm-router":
                kw = ({"kv": self.kv, "model": MODEL} if peer_policy == "kv_aware" else {})
                self.peer = vllm_router(tmp, self.urls, peer_policy, **kw)
            else:
                self.peer = sglang_router(tmp, self.urls, peer_policy)
            self.peer.start().wait_serving()
            print(f"#   {' '.join(self.peer.command)}", file=sys.stderr, flush=True)
            return self.peer.url
        (tmp / "engines.json").write_text(json.dumps(
            {"model": MODEL, "groups": [{"group": i, "url": u} for i, u in enumerate(self.urls)]}))
        (port,) = free_ports(1)
        cmd = [sys.executable, "-m", "shoal.cli", "router", "--model", model_dir,
               "--engine-discovery-file", str(tmp / "engines.json"), "--host", "127.0.0.1",
               "--port", str(port), "--served-model-name", MODEL]
        if policy == "kv-aware":
            cmd += ["--kv-tokenizer", model_dir]
            for i, u in enumerate(self.urls):
                cmd += ["--kv-endpoint", f"{i}={self.kv[u].events},{self.kv[u].replay}"]
        env = {**os.environ, "SHOAL_ROUTER_ROUTING": policy,
               "SHOAL_ROUTER_PREFIX_IMBALANCE": str(args.imbalance)}
        self._router = (cmd, env, tmp / f"router-{policy}.log")
        return self._spawn_router(f"http://127.0.0.1:{port}")

    def _spawn_router(self, url: str) -> str:
        cmd, env, log = self._router
        self.procs.append(subprocess.Popen(cmd, start_new_session=True, env=env,
                                           stdout=subprocess.DEVNULL, stderr=open(log, "a")))
        wait_healthy(url, self.procs[-1])
        wait_usable(url, len(self.urls))
        return url

    def restart_router(self) -> float:
        """SIGKILL Shoal's router and start it again on its port: seconds until it serves."""
        old = self.procs.pop()
        os.killpg(old.pid, signal.SIGKILL)
        old.wait(30)
        t0 = time.perf_counter()
        self._spawn_router(self.url)
        return time.perf_counter() - t0

    def stop(self) -> None:
        if self.peer is not None:
            self.peer.stop()
        for c in self.counters:
            c.close()
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


def kv_tokens(url: str) -> int:
    """The tokens a group's KV cache holds, from its own vllm:cache_config_info."""
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            labels = dict(kv.split("=", 1) for kv in line.split("{", 1)[1].split("}")[0]
                          .split(","))
            return int(labels["num_gpu_blocks"].strip('"')) * int(labels["block_size"].strip('"'))
    raise SystemExit(f"{url}: no vllm:cache_config_info")


def words(rnd: random.Random, chars: int) -> str:
    out: list[str] = []
    while sum(len(w) + 1 for w in out) < chars:
        out.append(rnd.choice(WORDS))
    return " ".join(out)


def workload(args, seed: int) -> tuple[list[str], list[tuple[int, str]]]:
    """The tenants' contexts, and (tenant, prompt) requests in a seeded shuffled order."""
    rnd = random.Random(seed)
    contexts = [f"Tenant {seed}-{t}. Context: " + words(rnd, args.context_chars)
                for t in range(args.tenants)]
    requests = [(t, f"{contexts[t]}\nUser {u}, question {k}: {words(rnd, args.query_chars)}?"
                 "\nAnswer:")
                for t in range(args.tenants) for u in range(args.users) for k in range(args.turns)]
    rnd.shuffle(requests)
    return contexts, requests


async def one(client: httpx.AsyncClient, url: str, prompt: str, args) -> tuple[float, float]:
    """TTFT of one streamed completion and the share of its prompt the engine served from its
    prefix cache (its usage.prompt_tokens_details, --enable-prompt-tokens-details); NaN for
    what a failed request did not say."""
    start = time.perf_counter()
    body = {"model": MODEL, "prompt": prompt, "max_tokens": args.max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0, "stream_options": {"include_usage": True}}
    ttft = cached = float("nan")
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                print(f"# HTTP {r.status_code}: {(await r.aread())[:300]!r}", file=sys.stderr)
                return ttft, cached
            async for line in r.aiter_lines():
                if ttft != ttft and line.startswith("data: {") and '"text":""' not in \
                        line.replace(" ", ""):
                    ttft = time.perf_counter() - start
                if line.startswith("data: {") and '"prompt_tokens_details"' in line:
                    usage = json.loads(line[6:])["usage"]
                    cached = (usage["prompt_tokens_details"]["cached_tokens"]
                              / max(1, usage["prompt_tokens"]))
    except httpx.HTTPError as exc:
        print(f"# {type(exc).__name__}: {exc}", file=sys.stderr)
    return ttft, cached


async def open_loop(url: str, prompts: list[str], rate: float, args,
                    seed: int = 0) -> tuple[list[tuple[float, float]], float]:
    """Send at Poisson arrivals of `rate`/s regardless of answers; each request's (TTFT,
    cached share) and the wall time."""
    rnd = random.Random(7 + seed)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None)) as c:
        start = time.perf_counter()
        tasks, t = [], 0.0
        for p in prompts:
            delay = start + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(c, url, p, args)))
            t += rnd.expovariate(rate)
        answers = await asyncio.gather(*tasks)
    return list(answers), time.perf_counter() - start


def snapshot(fleet: Fleet) -> dict[str, tuple[float, ...]]:
    return {u: (metric_sum(u, "vllm:prefix_cache_hits_total"),
                metric_sum(u, "vllm:prefix_cache_queries_total"),
                metric_sum(u, "vllm:request_success_total"),
                metric_sum(u, "vllm:generation_tokens_total"),
                c.removed) for u, c in zip(fleet.urls, fleet.counters, strict=True)}


def measure(args, policy: str, rate: float, seed: int = 0) -> dict:
    """One cell: fresh groups and router, the workload of `seed` (its tenants, order and
    arrivals)."""
    with tempfile.TemporaryDirectory(prefix="kv-routing-") as tmp:
        fleet = Fleet(args, policy, Path(tmp))
        try:
            _, warm = workload(args, seed=99)
            asyncio.run(open_loop(fleet.url, [p for _, p in warm[:args.groups * 2]], rate, args))
            before = snapshot(fleet)
            _, reqs = workload(args, seed=seed)
            answers, wall = asyncio.run(open_loop(fleet.url, [p for _, p in reqs], rate, args,
                                                  seed))
            time.sleep(0.5)  # the last BlockRemoved batches
            after = snapshot(fleet)
        finally:
            fleet.stop()
    d = {u: [a - b for a, b in zip(after[u], before[u], strict=True)] for u in after}
    hits, queries = sum(v[0] for v in d.values()), sum(v[1] for v in d.values())
    spread = [int(d[u][2]) for u in fleet.urls]
    return {"policy": policy, "rate": rate, "hits": hits, "queries": queries,
            "answers": answers,
            "tps": sum(v[3] for v in d.values()) / wall, "spread": spread,
            "evicted": int(sum(v[4] for v in d.values())), "kv_tokens": fleet.kv_tokens}


def merge(runs: list[dict]) -> dict:
    """The runs of one cell as one row: hits and queries, requests and evictions summed, TTFTs
    pooled, tok/s averaged; `hit_runs`: each run's own hit rate."""
    hits, queries = sum(r["hits"] for r in runs), sum(r["queries"] for r in runs)
    ttfts = [t for r in runs for t, _ in r["answers"]]
    return {"policy": runs[0]["policy"], "rate": runs[0]["rate"],
            "hit": hits / queries if queries else float("nan"),
            "hit_runs": [r["hits"] / r["queries"] if r["queries"] else float("nan")
                         for r in runs],
            "ttft50": 1e3 * pct(ttfts, 50), "ttft90": 1e3 * pct(ttfts, 90),
            "tps": sum(r["tps"] for r in runs) / len(runs),
            "spread": [sum(col) for col in zip(*(r["spread"] for r in runs), strict=True)],
            "errors": sum(1 for x in ttfts if x != x),
            "evicted": sum(r["evicted"] for r in runs), "kv_tokens": runs[0]["kv_tokens"],
            "ttfts": [x for x in ttfts if x == x],
            "ttft_runs": [[t for t, _ in r["answers"] if t == t] for r in runs],  # by seed
            "answers": [a for r in runs for a in r["answers"] if a[0] == a[0] and a[1] == a[1]]}


KINDS = (("misses (under 5% cached)", 0.0, 0.05), ("partial", 0.05, 0.8),
         ("hits (80% or more cached)", 0.8, 1.01))


def by_kind(answers: list[tuple[float, float]]) -> list[str]:
    """Per kind of request (KINDS, by the share the engine served from its cache): how many,
    TTFT p50 / p90 in ms: whether a policy's TTFT comes from fewer hits or from waiting."""
    out = []
    for _, lo, hi in KINDS:
        t = [ttft for ttft, c in answers if lo <= c < hi]
        out.append(f"{len(t)}: {1e3 * pct(t, 50):.0f} / {1e3 * pct(t, 90):.0f}" if t else "0")
    return out


def p90_gap(ours: list[float], theirs: list[float], draws: int = 2000,
            seed: int = 0) -> tuple[float, float, float]:
    """TTFT p90 of `theirs` minus `ours` (ms; positive: ours is faster), with a 90% bootstrap
    interval (each list resampled with replacement `draws` times): whether a gap between two
    rows is more than the table's noise."""
    rnd = random.Random(seed)
    gaps = sorted(1e3 * (pct(rnd.choices(theirs, k=len(theirs)), 90)
                         - pct(rnd.choices(ours, k=len(ours)), 90)) for _ in range(draws))
    return (1e3 * (pct(theirs, 90) - pct(ours, 90)), gaps[int(0.05 * draws)],
            gaps[int(0.95 * draws)])


T90 = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812, 1.796, 1.782,
       1.771, 1.761, 1.753)  # Student's t, 95th percentile, 1..15 degrees of freedom


def seed_gaps(ours: list[list[float]], theirs: list[list[float]]) -> list[float]:
    """Each seed's TTFT p90 gap, `theirs` minus `ours` (ms), for the seeds both answered."""
    return [1e3 * (pct(t, 90) - pct(o, 90)) for o, t in zip(ours, theirs, strict=True)
            if o and t]


def seed_gap(gaps: list[float]) -> tuple[float, float, float]:
    """The mean of the seeds' gaps (seed_gaps) with a 90% t-interval over the seeds: a seed's
    runs share tenants, order and arrivals, so the gap is paired by seed, and the interval sees
    how much a policy's p90 moves from run to run (which the pooled bootstrap does not). NaN
    bounds with fewer than two seeds."""
    n = len(gaps)
    if n == 0:
        return float("nan"), float("nan"), float("nan")
    mean = sum(gaps) / n
    if n < 2:
        return mean, float("nan"), float("nan")
    sd = (sum((g - mean) ** 2 for g in gaps) / (n - 1)) ** 0.5
    half = T90[min(n - 2, len(T90) - 1)] * sd / n ** 0.5
    return mean, mean - half, mean + half


class HitSampler:
    """The groups' prefix-cache hits and queries every `interval` s: (time, hits, queries)."""

    def __init__(self, urls: list[str], interval: float = 0.25) -> None:
        self.urls, self.interval, self.samples = urls, interval, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        names = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
        while not self._stop.is_set():
            t = time.perf_counter()
            hits = queries = 0.0
            for u in self.urls:  # both counters from one scrape, so a window is consistent
                text = httpx.get(f"{u}/metrics", timeout=10).text
                h, q = (metric_total(text, n) for n in names)
                hits, queries = hits + h, queries + q
            self.samples.append((t, hits, queries))
            self._stop.wait(self.interval)

    def rate(self, start: float, end: float) -> float:
        """The hit rate of the prefills counted between two times (nearest samples)."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2 or inside[-1][2] == inside[0][2]:
            return float("nan")
        return (inside[-1][1] - inside[0][1]) / (inside[-1][2] - inside[0][2])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def router_restart(args, rate: float, seed: int = 0, kill: bool = True) -> dict:
    """kv-aware, with the router SIGKILLed and restarted halfway through the workload: how long
    until it serves, until its index holds what the engines hold (their replay snapshots), and
    the hit rate before the kill, in the first 2 s after the restart and later. `kill` False:
    the same run undisturbed, its windows taken at the same point (the control)."""
    with tempfile.TemporaryDirectory(prefix="kv-routing-") as tmp:
        fleet = Fleet(args, "kv-aware", Path(tmp))
        sampler = None
        try:
            _, warm = workload(args, seed=99)
            asyncio.run(open_loop(fleet.url, [p for _, p in warm[:args.groups * 2]], rate, args))
            _, reqs = workload(args, seed=seed)
            prompts = [p for _, p in reqs]
            half = len(prompts) // 2
            sampler = HitSampler(fleet.urls)
            t_start = time.perf_counter()
            asyncio.run(open_loop(fleet.url, prompts[:half], rate, args, seed))
            t_kill = time.perf_counter()
            held = sum(c.stored - c.removed for c in fleet.counters)
            up_s = fleet.restart_router() if kill else 0.0
            t_up = time.perf_counter()
            second = threading.Thread(target=lambda: asyncio.run(
                open_loop(fleet.url, prompts[half:], rate, args, seed + 1000)))
            second.start()
            index_s = float("nan")
            while kill and time.perf_counter() - t_up < 30:
                if metric_sum(fleet.url, "shoal_router_kv_index_blocks") >= held:
                    index_s = time.perf_counter() - t_up
                    break
                time.sleep(0.05)
            second.join()
            t_end = time.perf_counter()
        finally:
            if sampler is not None:
                sampler.close()
            fleet.stop()
    return {"rate": rate, "held": held, "up_s": up_s, "index_s": index_s,
            "before": sampler.rate(t_start, t_kill), "first2": sampler.rate(t_up, t_up + 2),
            "after": sampler.rate(t_up + 2, t_end)}


def ceiling(args) -> tuple[float, int]:
    """(hit rate with an unbounded cache on one engine, the contexts' tokens): the engine's own
    tokenizer counts the tokens, its full blocks (16 tokens) are what a hit can reuse."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(MODELS / f"shoal-{args.model}" / "tokenizer.json"))
    contexts, reqs = workload(args, seed=0)
    ctx_tokens = [len(tok.encode(c).ids) for c in contexts]
    seen: set[int] = set()
    hit = total = 0
    for t, prompt in reqs:
        n = len(tok.encode(prompt).ids)
        total += n
        if t in seen:
            hit += min(ctx_tokens[t] - 1, n - 1) // 16 * 16
        seen.add(t)
    return hit / total, sum(ctx_tokens)


def oracle(args, capacity_blocks: int, seed: int = 0) -> float:
    """The hit rate of a router that knows every cache exactly and at once: a simulation (no
    engine can be asked this), sequential in the workload's order. Each group is an LRU cache
    of `capacity_blocks` 16-token blocks keyed by their chained token ids, as the engine's
    prefix cache is (a request's full blocks are cached when it finishes, the least recently
    used free ones evicted first); a request goes to the group caching its longest prefix, and
    a miss to its tenant's home (tenants spread evenly over the groups, so that no group caches
    a second copy of a context). Concurrency is left out: this is an upper mark for the table's
    hit rates, not a policy anyone can run."""
    from collections import OrderedDict

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(MODELS / f"shoal-{args.model}" / "tokenizer.json"))
    _, reqs = workload(args, seed=seed)
    caches: list[OrderedDict] = [OrderedDict() for _ in range(args.groups)]
    hit = total = 0
    for t, prompt in reqs:
        ids = tok.encode(prompt).ids
        keys, h = [], 0
        for i in range(len(ids) // 16):
            h = hash((h, tuple(ids[i * 16:(i + 1) * 16])))
            keys.append(h)

        def cached(cache, keys=keys) -> int:
            n = 0
            while n < len(keys) and keys[n] in cache:
                n += 1
            return n
        found = [cached(c) for c in caches]
        best = max(found)
        g = found.index(best) if best else t % args.groups
        cache = caches[g]
        n = min(found[g], (len(ids) - 1) // 16)  # the last token is always computed
        hit += 16 * n
        total += len(ids)
        for k in reversed(keys):  # freed tail first, as the engine frees: the head goes last
            cache[k] = True
            cache.move_to_end(k)
        while len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return hit / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["tiny", "small"], default="tiny")
    ap.add_argument("--groups", type=int, default=3)
    ap.add_argument("--tenants", type=int, default=12)
    ap.add_argument("--users", type=int, default=4, help="users per tenant")
    ap.add_argument("--turns", type=int, default=3, help="questions per user")
    ap.add_argument("--context-chars", type=int, default=2400, help="each tenant's context")
    ap.add_argument("--query-chars", type=int, default=60)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--kv", default=str(104 * 32768), help="KV cache bytes of each group "
                    "(default: 104 blocks of 16 tokens of the tiny model, 32 KiB each in bf16)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per group")
    ap.add_argument("--imbalance", type=int, default=4, help="prefix-affinity's bound")
    ap.add_argument("--rates", type=float, nargs="+", default=[2.0, 4.0, 8.0])
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--repeats", type=int, default=1, help="runs per cell, workload seeds 0.. "
                    "(other tenants, order and arrivals each); a row sums them")
    ap.add_argument("--router-restart", action="store_true", help="instead of the table: "
                    "kv-aware at each rate with its router SIGKILLed and restarted halfway")
    args = ap.parse_args()
    if args.router_restart:
        print(cpu_flags())
        print("\n| rate (req/s) | seed | blocks the engines held | router serving again (s) | "
              "index whole again (s) | hit rate before the kill | first 2 s after | after that "
              "| undisturbed run: first 2 s | after that |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for rate in args.rates:
            for seed in range(args.repeats):
                r = router_restart(args, rate, seed)
                c = router_restart(args, rate, seed, kill=False)
                print(f"| {rate:g} | {seed} | {r['held']} | {r['up_s']:.2f} | "
                      f"{r['index_s']:.2f} | {100 * r['before']:.1f}% | "
                      f"{100 * r['first2']:.1f}% | {100 * r['after']:.1f}% | "
                      f"{100 * c['first2']:.1f}% | {100 * c['after']:.1f}% |", flush=True)
        return
    ensure_peer_routers()
    print(cpu_flags())
    top, ctx_tokens = ceiling(args)
    n = args.tenants * args.users * args.turns
    print(f"# {args.groups} groups of shoal-{args.model} (KV {args.kv} bytes each, "
          f"{args.threads} thread(s)); {args.tenants} tenants x {args.users} users x "
          f"{args.turns} questions = {n} requests, contexts of {args.context_chars} chars "
          f"({ctx_tokens} tokens in all), {args.max_tokens} output tokens, open loop",
          flush=True)
    if args.repeats > 1:
        print(f"# {args.repeats} runs per cell (workload seeds 0-{args.repeats - 1}), in turn "
              "across the policies (each seed starting with the next); a row sums them (TTFTs "
              "pooled)", flush=True)
    runs: dict[tuple[float, str], list[dict]] = {}
    for rate in args.rates:
        for seed in range(args.repeats):  # in turn, so a slow minute hits every policy,
            k = seed % len(args.policies)  # each seed starting with the next one
            for policy in args.policies[k:] + args.policies[:k]:
                r = measure(args, policy, rate, seed)
                runs.setdefault((rate, policy), []).append(r)
                print(f"# {policy} at {rate}/s, seed {seed}: hit "
                      f"{100 * r['hits'] / max(1, r['queries']):.1f}%, spread {r['spread']}",
                      file=sys.stderr, flush=True)
    rows = [merge(v) for v in runs.values()]
    print("\n| rate (req/s) | policy | prefix-cache hit rate | each run | TTFT p50 (ms) | "
          "TTFT p90 (ms) | output tok/s | requests per group | max/min | blocks evicted | "
          "errors |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        lo, hi = min(r["spread"]), max(r["spread"])
        ratio = f"{hi / lo:.2f}" if lo else "inf"
        each = " / ".join(f"{100 * h:.1f}" for h in r["hit_runs"])
        print(f"| {r['rate']:g} | {r['policy']} | {100 * r['hit']:.1f}% | {each} | "
              f"{r['ttft50']:.0f} | {r['ttft90']:.0f} | {r['tps']:.1f} | "
              f"{' / '.join(map(str, r['spread']))} | {ratio} | {r['evicted']} | "
              f"{r['errors']} |")
    ours = {r["rate"]: r for r in rows if r["policy"] == "kv-aware"}
    if ours:
        print("\nTTFT p90 of each policy minus kv-aware's (ms; positive: kv-aware is faster), "
              "with a 90% bootstrap interval over the pooled TTFTs, and the same gap seed by "
              "seed (each seed's runs share tenants, order and arrivals; the spread between "
              "seeds is what the pooled interval does not see):\n")
        print("| rate (req/s) | policy | p90 gap (ms) | 90% interval (ms) | each seed (ms) | "
              "mean of the seeds' gaps (90% t-interval, ms) |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            if r["policy"] != "kv-aware" and r["rate"] in ours and r["ttfts"]:
                kv = ours[r["rate"]]
                gap, lo, hi = p90_gap(kv["ttfts"], r["ttfts"])
                gaps = seed_gaps(kv["ttft_runs"], r["ttft_runs"])
                each = " / ".join(f"{g:+.0f}" for g in gaps)
                mean, slo, shi = seed_gap(gaps)
                print(f"| {r['rate']:g} | {r['policy']} | {gap:+.0f} | {lo:+.0f} .. {hi:+.0f} "
                      f"| {each} | {mean:+.0f} ({slo:+.0f} .. {shi:+.0f}) |")
    print("\nTTFT by what the engine found cached (its usage.prompt_tokens_details): requests, "
          "p50 / p90 (ms):\n")
    print("| rate (req/s) | policy | " + " | ".join(k for k, _, _ in KINDS) + " |")
    print("|---|---|" + "---|" * len(KINDS))
    for r in rows:
        print(f"| {r['rate']:g} | {r['policy']} | " + " | ".join(by_kind(r["answers"])) + " |")
    cap = rows[0]["kv_tokens"]
    best = sum(oracle(args, cap // args.groups // 16, seed)
               for seed in range(args.repeats)) / args.repeats
    print(f"\nThe contexts' {ctx_tokens} tokens are {ctx_tokens / cap:.2f}x the {cap} tokens the "
          f"groups' KV caches hold together (their vllm:cache_config_info). Oracle (simulated: "
          f"exact caches, no event lag, each tenant homed): {100 * best:.1f}%; ceiling (one "
          f"unbounded cache): {100 * top:.1f}%.")


if __name__ == "__main__":
    main()
