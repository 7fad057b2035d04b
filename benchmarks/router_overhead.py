"""What the fleet gateway adds with large prompts, in the shape of llm-d-router #1109 (1.1 s of
added TTFT there), scaled to this machine; and the gateway's memory over a long run of unique
prefixes (production-stack #687: router memory that grows without bound).

Real parts: `--groups` `shoal serve` groups of the tiny model with KV events on, and a
`shoal gateway` in front of them routing `--routing` (kv-aware: it tokenizes each prompt's
leading 16 KB, looks it up in its KV index and records a claim; every group's events feed the
index). Prompts are unique text of `--min-kb`..`--max-kb` KB (random words). The tiny model
takes 2,048 positions, so every request asks `truncate_prompt_tokens` (`--keep` tokens: the
engine still reads and tokenizes the whole body, as vLLM does, then prefills the last tokens)
and `max_tokens` 1: the engine answers one token, as #1109's does.

Phase 1, added TTFT: `--concurrency` clients, each alternating one request straight to a group
(round robin) and one through the gateway, streamed; TTFT is the time to the first streamed
token; `--requests` per path after a warm-up. The added TTFT is the gateway's p50/p99 minus the
direct path's (both paths share the machine's cores, so the gateway's CPU shows in both).

Phase 2, memory: `--minutes` of the same clients through the gateway only, unique prefixes;
the gateway's RSS (/proc/PID/status VmRSS), its KV index size and claims sampled every
`--sample-s` seconds, printed as a table.

    PYTHONPATH=tests .venv/bin/python benchmarks/router_overhead.py --minutes 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prefix_routing import MODELS, WORDS, cpu_flags, metric_sum, pct, wait_healthy, wait_usable
from support.net import free_ports

MODEL = "m"


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Prompts:
    """Unique prompts of min..max KB: a serial number first, so no two share a prefix."""

    def __init__(self, min_kb: int, max_kb: int, seed: int = 0) -> None:
        self.rnd = random.Random(seed)
        self.min, self.max = min_kb * 1024, max_kb * 1024
        self.n = 0
        self.words = WORDS

    def next(self) -> str:
        self.n += 1
        size = self.rnd.randint(self.min, self.max)
        head = f"Request {self.n} {self.rnd.random()}: "
        body = " ".join(self.rnd.choices(self.words, k=size // 7 + 1))
        return (head + body)[:size]


async def ttft(client: httpx.AsyncClient, url: str, prompt: str, keep: int) -> float:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "stream": True, "temperature": 0,
            "truncate_prompt_tokens": keep}
    start = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - start
    raise RuntimeError(f"{url}: no token")


async def phase1(args, groups: list[str], gateway: str, prompts: Prompts):
    direct, via = [], []
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None)) as c:
        async def client(i: int, n: int, record: bool) -> None:
            for k in range(n):
                group = groups[(i + k) % len(groups)]
                d = await ttft(c, group, prompts.next(), args.keep)
                v = await ttft(c, gateway, prompts.next(), args.keep)
                if record:
                    direct.append(d)
                    via.append(v)
        await asyncio.gather(*(client(i, 2, False) for i in range(args.concurrency)))
        per = max(1, args.requests // args.concurrency)
        await asyncio.gather(*(client(i, per, True) for i in range(args.concurrency)))
    return direct, via


async def phase2(args, gateway: str, gw_pid: int, prompts: Prompts) -> list[tuple]:
    rows: list[tuple] = []
    done = [0, 0]  # ok, failed
    stop = time.monotonic() + 60 * args.minutes
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None)) as c:
        async def client() -> None:
            while time.monotonic() < stop:
                try:
                    await ttft(c, gateway, prompts.next(), args.keep)
                    done[0] += 1
                except (RuntimeError, httpx.HTTPError) as exc:
                    done[1] += 1
                    print(f"# {exc}", file=sys.stderr)

        async def sampler() -> None:
            t0 = time.monotonic()
            while True:
                m = await asyncio.to_thread(metric_sum, gateway, "shoal_router_kv_index_blocks")
                rows.append((time.monotonic() - t0, rss_mib(gw_pid), m, done[0], done[1]))
                print(f"# {rows[-1][0]:.0f}s rss {rows[-1][1]:.1f} MiB index {m:.0f} blocks "
                      f"requests {done[0]} failed {done[1]}", file=sys.stderr, flush=True)
                if time.monotonic() >= stop:
                    return
                await asyncio.sleep(min(args.sample_s, max(0.0, stop - time.monotonic())))
        await asyncio.gather(sampler(), *(client() for _ in range(args.concurrency)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--routing", default="kv-aware",
                    choices=["least-outstanding", "prefix-affinity", "kv-aware"])
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--requests", type=int, default=200, help="per path, phase 1")
    ap.add_argument("--min-kb", type=int, default=100)
    ap.add_argument("--max-kb", type=int, default=220)
    ap.add_argument("--keep", type=int, default=256, help="truncate_prompt_tokens")
    ap.add_argument("--minutes", type=float, default=30.0, help="phase 2; 0 skips it")
    ap.add_argument("--sample-s", type=float, default=60.0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per group")
    args = ap.parse_args()
    print(cpu_flags())
    model_dir = str(MODELS / "shoal-tiny")
    py = sys.executable
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="router-overhead-") as tmp:
        groups, endpoints = [], []
        for i in range(args.groups):
            port, ev, rp = free_ports(3)
            cfg = {"enable_kv_cache_events": True, "publisher": "zmq",
                   "endpoint": f"tcp://*:{ev}", "replay_endpoint": f"tcp://*:{rp}"}
            procs.append(subprocess.Popen(
                [py, "-m", "shoal.cli", "serve", model_dir, "--host", "127.0.0.1", "--port",
                 str(port), "--served-model-name", MODEL, "--kv-cache-memory-bytes", "256M",
                 "--num-threads", str(args.threads), "--kv-events-config", json.dumps(cfg)],
                start_new_session=True, stdout=subprocess.DEVNULL,
                stderr=open(Path(tmp) / f"serve-{i}.log", "w")))
            groups.append(f"http://127.0.0.1:{port}")
            endpoints += ["--kv-endpoint",
                          f"{MODEL}/{i}=tcp://127.0.0.1:{ev},tcp://127.0.0.1:{rp}"]
        (Path(tmp) / f"{MODEL}.json").write_text(json.dumps(
            {"model": MODEL, "groups": [{"group": i, "url": u} for i, u in enumerate(groups)]}))
        (gport,) = free_ports(1)
        gateway = f"http://127.0.0.1:{gport}"
        cmd = [py, "-m", "shoal.router.gateway", "--host", "127.0.0.1", "--port", str(gport),
               "--discovery-dir", tmp, "--routing", args.routing]
        if args.routing == "kv-aware":
            cmd += ["--kv-tokenizer", model_dir, *endpoints]
        procs.append(subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL,
                                      stderr=open(Path(tmp) / "gateway.log", "w")))
        try:
            for url, p in zip(groups, procs, strict=False):
                wait_healthy(url, p)
            wait_healthy(gateway, procs[-1])
            wait_usable(gateway, args.groups)
            prompts = Prompts(args.min_kb, args.max_kb)
            rss0 = rss_mib(procs[-1].pid)
            direct, via = asyncio.run(phase1(args, groups, gateway, prompts))
            rows = asyncio.run(phase2(args, gateway, procs[-1].pid, prompts)) \
                if args.minutes > 0 else []
            stale = metric_sum(gateway, "shoal_router_kv_group_stale")
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    p.kill()
            log = (Path(tmp) / "gateway.log").read_text()
    print(f"\n# {args.groups} groups of shoal-tiny, gateway routing {args.routing}, unique "
          f"prompts of {args.min_kb}-{args.max_kb} KB, truncate_prompt_tokens {args.keep}, "
          f"max_tokens 1, {args.concurrency} concurrent clients alternating direct / gateway, "
          f"{len(direct)} requests per path; load average {os.getloadavg()[0]:.1f}")
    print("| path | TTFT p50 (ms) | TTFT p90 (ms) | TTFT p99 (ms) |")
    print("|---|---|---|---|")
    for name, xs in (("direct to a group", direct), ("through the gateway", via)):
        print(f"| {name} | {1e3 * pct(xs, 50):.0f} | {1e3 * pct(xs, 90):.0f} | "
              f"{1e3 * pct(xs, 99):.0f} |")
    print(f"| added by the gateway | {1e3 * (pct(via, 50) - pct(direct, 50)):.0f} | "
          f"{1e3 * (pct(via, 90) - pct(direct, 90)):.0f} | "
          f"{1e3 * (pct(via, 99) - pct(direct, 99)):.0f} |")
    print(f"\nGateway RSS before phase 1: {rss0:.1f} MiB; groups stale at the end: {stale:.0f}; "
          f"gateway log lines with a traceback: {log.count('Traceback')}")
    if rows:
        print(f"\n# phase 2: {args.minutes:g} min of unique prompts through the gateway")
        print("| minute | gateway RSS (MiB) | KV index blocks | requests done | failed |")
        print("|---|---|---|---|---|")
        for t, rss, blocks, ok, bad in rows:
            print(f"| {t / 60:.1f} | {rss:.1f} | {blocks:.0f} | {ok} | {bad} |")


if __name__ == "__main__":
    main()
