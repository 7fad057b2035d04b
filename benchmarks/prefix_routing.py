"""Prefix-affinity vs least-outstanding routing, through the fleet gateway, on local groups.

Workload: `--systems` system prompts of `--system-chars` characters each (the shared prefixes,
as many applications' requests share one), `--per-system` chat requests per system prompt with
a short question of their own, in a seeded shuffled order, `--concurrency` at a time (closed
loop), streamed, `--max-tokens` output tokens. For each routing the script starts `--groups`
fresh `shoal serve` groups (empty prefix caches; `--kv` KV cache each, small enough that one
group cannot hold every system prompt) and a gateway (`python -m shoal.router.gateway`)
over them, runs the workload once to warm nothing but the process (a different seed), then
measures:

- prefix-cache hit rate: the groups' own `vllm:prefix_cache_hits` / `vllm:prefix_cache_queries`
  (tokens) over the measured run, summed over groups;
- TTFT p50/p99 (client side: request sent -> first content token), end-to-end p50, requests/s;
- spread: requests per group (from each group's `vllm:request_success`).

    .venv/bin/python benchmarks/prefix_routing.py --model tiny
    .venv/bin/python benchmarks/prefix_routing.py --model small --kv 96M

It prints the machine's CPU flags and one table (benchmarks/README.md has the figures).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

MODELS = Path(os.environ.get("SHOAL_CACHE", Path.home() / ".cache" / "shoal")) / "models"
WORDS = ("account invoice refund policy customer order shipping address payment card warranty "
         "return label discount coupon delivery tracking support ticket escalation priority "
         "manager credit balance statement subscription renewal cancel upgrade plan").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_flags() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((ln.split(":", 1)[1].strip() for ln in out.splitlines()
                  if ln.startswith("Model name")), "?")
    flags = next((ln.split(":", 1)[1].strip() for ln in out.splitlines()
                  if ln.startswith("Flags")), "?")
    return f"CPU: {model}, {os.cpu_count()} cores\nFlags: {flags}"


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url}: exited with {proc.returncode} during start-up")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} was not healthy within {timeout} s")


def wait_usable(gateway: str, n: int, timeout: float = 60) -> None:
    """The gateway probed the groups while they were starting: wait out those cool-downs."""
    deadline = time.monotonic() + timeout
    while metric_sum(gateway, "shoal_router_groups_usable") < n:
        if time.monotonic() > deadline:
            raise SystemExit(f"the gateway did not see {n} usable group(s) within {timeout} s")
        time.sleep(0.2)


def metric_total(text: str, name: str) -> float:
    """The sum of every series of `name` in a Prometheus exposition."""
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.startswith(name + "{") or ln.startswith(name + " "))


def metric_sum(url: str, name: str) -> float:
    return metric_total(httpx.get(f"{url}/metrics", timeout=10).text, name)


class Fleet:
    """`groups` fresh `shoal serve` processes and one gateway over them."""

    def __init__(self, args, routing: str, tmp: Path) -> None:
        self.procs: list[subprocess.Popen] = []
        self.urls: list[str] = []
        py = sys.executable
        for _ in range(args.groups):
            port = free_port()
            cmd = [py, "-m", "shoal.cli", "serve", str(MODELS / f"shoal-{args.model}"),
                   "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "m",
                   "--kv-cache-memory-bytes", args.kv, "--num-threads", str(args.threads),
                   "--max-model-len", "2048"]
            self.procs.append(subprocess.Popen(cmd, start_new_session=True,
                                               stdout=subprocess.DEVNULL,
                                               stderr=open(tmp / f"serve-{port}.log", "w")))
            self.urls.append(f"http://127.0.0.1:{port}")
        (tmp / "discovery").mkdir(exist_ok=True)
        (tmp / "discovery" / "m.json").write_text(json.dumps(
            {"model": "m", "groups": [{"group": i, "url": u} for i, u in enumerate(self.urls)]}))
        port = free_port()
        self.gateway = f"http://127.0.0.1:{port}"
        self.procs.append(subprocess.Popen(
            [py, "-m", "shoal.router.gateway", "--host", "127.0.0.1", "--port", str(port),
             "--discovery-dir", str(tmp / "discovery"), "--routing", routing,
             "--prefix-imbalance", str(args.imbalance)],
            start_new_session=True, stdout=subprocess.DEVNULL,
            stderr=open(tmp / f"gateway-{routing}.log", "w")))
        for url, proc in zip(self.urls + [self.gateway], self.procs, strict=True):
            wait_healthy(url, proc)
        wait_usable(self.gateway, len(self.urls))

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


def workload(args, seed: int) -> list[list[dict]]:
    rnd = random.Random(1000 + seed)
    systems = []
    for s in range(args.systems):
        words = []
        while sum(len(w) + 1 for w in words) < args.system_chars:
            words.append(rnd.choice(WORDS))
        systems.append(f"System {seed}-{s}: you answer questions about " + " ".join(words))
    requests = [[{"role": "system", "content": sys_}, {"role": "user", "content":
                 f"Question {i}: " + " ".join(rnd.choice(WORDS) for _ in range(12))}]
                for sys_ in systems for i in range(args.per_system)]
    rnd.shuffle(requests)
    return requests


async def one(client: httpx.AsyncClient, url: str, messages, args) -> tuple[float, float]:
    start = time.perf_counter()
    ttft = None
    body = {"model": "m", "messages": messages, "max_tokens": args.max_tokens,
            "ignore_eos": True, "stream": True, "temperature": 0}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if ttft is None and line.startswith("data: {") and '"content":"' in line.replace(
                    " ", "") and '"content":""' not in line.replace(" ", ""):
                ttft = time.perf_counter() - start
    return ttft if ttft is not None else float("nan"), time.perf_counter() - start


async def drive(url: str, requests, args) -> tuple[list[float], list[float], float]:
    queue = list(requests)
    ttfts, e2es = [], []

    async def worker(client):
        while queue:
            t, e = await one(client, url, queue.pop(), args)
            ttfts.append(t)
            e2es.append(e)

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(worker(client) for _ in range(args.concurrency)))
    return ttfts, e2es, time.perf_counter() - start


def pct(xs: list[float], q: float) -> float:
    xs = sorted(x for x in xs if x == x)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


def measure(args, routing: str) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"prefix-{routing}-") as tmp:
        fleet = Fleet(args, routing, Path(tmp))
        try:
            asyncio.run(drive(fleet.gateway, workload(args, seed=99)[:args.groups * 2], args))
            before = {u: (metric_sum(u, "vllm:prefix_cache_hits_total"),
                          metric_sum(u, "vllm:prefix_cache_queries_total"),
                          metric_sum(u, "vllm:request_success_total")) for u in fleet.urls}
            ttfts, e2es, wall = asyncio.run(drive(fleet.gateway, workload(args, seed=0), args))
            after = {u: (metric_sum(u, "vllm:prefix_cache_hits_total"),
                         metric_sum(u, "vllm:prefix_cache_queries_total"),
                         metric_sum(u, "vllm:request_success_total")) for u in fleet.urls}
        finally:
            fleet.stop()
    hits = sum(after[u][0] - before[u][0] for u in after)
    queries = sum(after[u][1] - before[u][1] for u in after)
    spread = [int(after[u][2] - before[u][2]) for u in fleet.urls]
    return {"routing": routing, "hit": hits / queries if queries else float("nan"),
            "queries": queries, "ttft50": 1e3 * pct(ttfts, 50), "ttft99": 1e3 * pct(ttfts, 99),
            "e2e50": 1e3 * pct(e2es, 50), "rps": len(e2es) / wall, "spread": spread,
            "ttft_mean": 1e3 * statistics.fmean(x for x in ttfts if x == x)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["tiny", "small"], default="tiny")
    ap.add_argument("--groups", type=int, default=3)
    ap.add_argument("--systems", type=int, default=6, help="distinct system prompts")
    ap.add_argument("--per-system", type=int, default=12, help="requests per system prompt")
    ap.add_argument("--system-chars", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--kv", default="16M", help="KV cache of each group (16M: about 4,000 "
                    "tokens of the tiny model, 5 of the default system prompts)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per group")
    ap.add_argument("--imbalance", type=int, default=4)
    ap.add_argument("--routings", nargs="+", default=["least-outstanding", "prefix-affinity"])
    args = ap.parse_args()
    print(cpu_flags())
    print(f"# {args.groups} groups of shoal-{args.model} (KV {args.kv}, {args.threads} thread(s) "
          f"each), {args.systems} system prompts x {args.per_system} requests, "
          f"{args.system_chars} chars each, concurrency {args.concurrency}, "
          f"{args.max_tokens} output tokens", flush=True)
    rows = []
    for routing in args.routings:
        rows.append(measure(args, routing))
        print(f"# {routing} done", file=sys.stderr, flush=True)
    print("\n| routing | prefix-cache hit rate | prompt tokens queried | TTFT p50 (ms) | "
          "TTFT p99 (ms) | e2e p50 (ms) | requests/s | requests per group |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['routing']} | {100 * r['hit']:.1f}% | {r['queries']:.0f} | "
              f"{r['ttft50']:.0f} | {r['ttft99']:.0f} | {r['e2e50']:.0f} | {r['rps']:.2f} | "
              f"{' / '.join(map(str, r['spread']))} |")


if __name__ == "__main__":
    main()
