"""Load client for any OpenAI-compatible /v1/completions endpoint (like `vllm bench serve`).

Random prompts of exactly N tokens (sent as token-id lists), M output tokens each with
ignore_eos, arrivals at a fixed Poisson rate or all at once (inf), an optional concurrency cap.
Prints output tokens/s, requests/s, TTFT and inter-token latency (median, p99) and, when it knows
the server's processes, the frontend's and engine's resident memory (peak during the run).
Like vLLM's client it streams over aiohttp: on a 2-core machine the load client shares the cores
with the server, so its own CPU cost (printed too) is part of what is measured.

Against a running server:
    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --model shoal-tiny \\
        --num-prompts 200 --input-len 128 --output-len 128 --request-rate inf
Or let it start one (and measure start-up to a healthy /health):
    python benchmarks/serve.py --launch "shoal serve ~/.cache/shoal/models/shoal-tiny \\
        --port 8123 --served-model-name shoal-tiny" --base-url http://127.0.0.1:8123 ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field

import aiohttp
import httpx
import psutil


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    latency: float = 0.0
    output_tokens: int = 0


async def one_request(session: aiohttp.ClientSession, args, prompt: list[int]) -> Result:
    body = {"model": args.model, "prompt": prompt, "max_tokens": args.output_len,
            "temperature": args.temperature, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    res = Result()
    start = last = time.perf_counter()
    try:
        async with session.post(f"{args.base_url}/v1/completions", json=body) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.read())[:200]!r}"
                return res
            buffer = b""
            async for data in r.content.iter_any():
                buffer += data
                *events, buffer = buffer.split(b"\n\n")
                for event in events:
                    line = event.strip()
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        res.error = chunk["error"]["message"]
                        return res
                    if chunk.get("usage"):
                        res.output_tokens = chunk["usage"]["completion_tokens"]
                    if chunk.get("choices") and chunk["choices"][0].get("text"):
                        now = time.perf_counter()
                        if res.ttft == 0.0:
                            res.ttft = now - start
                        else:
                            res.itls.append(now - last)
                        last = now
        res.latency = time.perf_counter() - start
        res.ok = res.output_tokens > 0
    except aiohttp.ClientError as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


class RssSampler:
    """Peak RSS of the server's frontend process and of its engine child(ren), and the CPU
    seconds each spent during the run (which process is the bottleneck)."""

    def __init__(self, pid: int | None) -> None:
        self.pid = pid
        self.frontend = self.engine = 0
        self.cpu_start: tuple[float, float] | None = None
        self.cpu_end: tuple[float, float] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                proc = psutil.Process(self.pid)
                self.frontend = max(self.frontend, proc.memory_info().rss)
                children = proc.children(recursive=True)
                kids = sum(k.memory_info().rss for k in children)
                self.engine = max(self.engine, kids)
                cpu = (sum(proc.cpu_times()[:2]),
                       sum(sum(k.cpu_times()[:2]) for k in children))
                if self.cpu_start is None:
                    self.cpu_start = cpu
                self.cpu_end = cpu
            except psutil.Error:
                pass
            self._stop.wait(0.25)

    def __enter__(self) -> RssSampler:
        if self.pid:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


async def run(args) -> dict:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(args.min_token_id, args.vocab_size) for _ in range(args.input_len)]
               for _ in range(args.num_prompts)]
    sem = asyncio.Semaphore(args.max_concurrency or args.num_prompts)
    async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None),
            headers={"Authorization": f"Bearer {args.api_key}"}) as session:
        async def guarded(p):
            async with sem:
                return await one_request(session, args, p)

        tasks = []
        cpu_start = time.process_time()
        start = time.perf_counter()
        for p in prompts:
            tasks.append(asyncio.create_task(guarded(p)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        client_cpu = time.process_time() - cpu_start
    ok = [r for r in results if r.ok]
    errors = [r.error for r in results if not r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    itls = [x for r in ok for x in r.itls]
    return {
        "completed": len(ok), "failed": len(errors), "first_error": errors[0] if errors else "",
        "duration_s": duration, "req_per_s": len(ok) / duration,
        "output_tok_per_s": out_tokens / duration,
        "total_tok_per_s": (out_tokens + len(ok) * args.input_len) / duration,
        "ttft_median_ms": 1e3 * pct([r.ttft for r in ok], 50),
        "ttft_p99_ms": 1e3 * pct([r.ttft for r in ok], 99),
        "itl_median_ms": 1e3 * pct(itls, 50), "itl_p99_ms": 1e3 * pct(itls, 99),
        "e2e_median_s": pct([r.latency for r in ok], 50),
        "client_cpu_s": client_cpu,
    }


def launch(command: str, base_url: str, timeout: float,
           env: dict[str, str] | None = None) -> tuple[subprocess.Popen, float]:
    start = time.perf_counter()
    proc = subprocess.Popen(shlex.split(command), start_new_session=True,
                            env={**os.environ, **(env or {})})
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} during start-up")
        try:
            if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                return proc, time.perf_counter() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"the server was not healthy within {timeout} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="shoal-tiny", help="the `model` field sent")
    ap.add_argument("--api-key", default="EMPTY")
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--request-rate", type=float, default=float("inf"),
                    help="Poisson arrivals per second; inf = all at once")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--min-token-id", type=int, default=10, help="skip special tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-pid", type=int, default=None,
                    help="frontend pid: report its and its children's (engine) peak RSS")
    ap.add_argument("--launch", default=None,
                    help="start this server command first; report start-up time; stop it after")
    ap.add_argument("--startup-timeout", type=float, default=300)
    ap.add_argument("--json", action="store_true", help="also print the result as JSON")
    args = ap.parse_args()

    proc, startup = None, None
    if args.launch:
        proc, startup = launch(args.launch, args.base_url, args.startup_timeout)
        args.server_pid = proc.pid
    try:
        with RssSampler(args.server_pid) as rss:
            r = asyncio.run(run(args))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    rate = "inf" if args.request_rate == float("inf") else f"{args.request_rate:g}"
    print(f"\n{args.num_prompts} prompts, {args.input_len} in / {args.output_len} out, "
          f"rate {rate}, concurrency cap {args.max_concurrency or 'none'}")
    if startup is not None:
        print(f"start-up to healthy /health: {startup:.1f} s")
    print("| metric | value |\n|---|---:|")
    print(f"| completed / failed | {r['completed']} / {r['failed']} |")
    print(f"| duration (s) | {r['duration_s']:.1f} |")
    print(f"| requests/s | {r['req_per_s']:.2f} |")
    print(f"| output tokens/s | {r['output_tok_per_s']:.0f} |")
    print(f"| total tokens/s | {r['total_tok_per_s']:.0f} |")
    print(f"| TTFT median / p99 (ms) | {r['ttft_median_ms']:.0f} / {r['ttft_p99_ms']:.0f} |")
    print(f"| ITL median / p99 (ms) | {r['itl_median_ms']:.1f} / {r['itl_p99_ms']:.1f} |")
    print(f"| E2E median (s) | {r['e2e_median_s']:.2f} |")
    print(f"| CPU seconds load client | {r['client_cpu_s']:.1f} |")
    if args.server_pid:
        print(f"| frontend RSS peak (MiB) | {rss.frontend / 2**20:.0f} |")
        print(f"| engine RSS peak (MiB) | {rss.engine / 2**20:.0f} |")
        if rss.cpu_start and rss.cpu_end:
            fe, en = (b - a for a, b in zip(rss.cpu_start, rss.cpu_end, strict=True))
            print(f"| CPU seconds frontend / engine | {fe:.1f} / {en:.1f} |")
    if r["first_error"]:
        print(f"first error: {r['first_error']}")
    if args.json:
        print(json.dumps({**r, "startup_s": startup}))


if __name__ == "__main__":
    main()
