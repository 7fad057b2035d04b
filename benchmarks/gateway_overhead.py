"""What the fleet gateway adds to a request: the same requests sent to one `shoal serve` group
directly and through a gateway in front of it, alternating one by one (so drift in the
machine's speed hits both alike), one at a time.

Requests: `/v1/completions`, a short prompt, `--max-tokens` output tokens (1: the request is
mostly HTTP and scheduling, so the gateway's share shows), non-streamed; and streamed, where the
figure is the time to the first token. Prints the CPU flags and a table of p50/p99 latency
direct, through the gateway, and the difference of the p50s and p99s.

    .venv/bin/python benchmarks/gateway_overhead.py --requests 300
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prefix_routing import MODELS, cpu_flags, free_port, pct, wait_healthy, wait_usable


def timed(client: httpx.Client, url: str, stream: bool, max_tokens: int) -> float:
    body = {"model": "m", "prompt": "The quick brown fox", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": stream, "temperature": 0}
    start = time.perf_counter()
    if not stream:
        r = client.post(f"{url}/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return time.perf_counter() - start
    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):  # a completion stream's first event is its first token
                return time.perf_counter() - start
    raise AssertionError("no token")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["tiny", "small"], default="tiny")
    ap.add_argument("--requests", type=int, default=300, help="per path and mode")
    ap.add_argument("--max-tokens", type=int, default=1)
    args = ap.parse_args()
    print(cpu_flags())
    py = sys.executable
    with tempfile.TemporaryDirectory(prefix="gw-overhead-") as tmp:
        port, gport = free_port(), free_port()
        engine = f"http://127.0.0.1:{port}"
        gateway = f"http://127.0.0.1:{gport}"
        (Path(tmp) / "m.json").write_text(json.dumps(
            {"model": "m", "groups": [{"group": 0, "url": engine}]}))
        procs = [subprocess.Popen([py, "-m", "shoal.cli", "serve",
                                   str(MODELS / f"shoal-{args.model}"), "--host", "127.0.0.1",
                                   "--port", str(port), "--served-model-name", "m",
                                   "--kv-cache-memory-bytes", "64M"],
                                  start_new_session=True, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL),
                 subprocess.Popen([py, "-m", "shoal.router.gateway", "--host",
                                   "127.0.0.1", "--port", str(gport), "--discovery-dir", tmp],
                                  start_new_session=True, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)]
        try:
            wait_healthy(engine, procs[0])
            wait_healthy(gateway, procs[1])
            wait_usable(gateway, 1)
            rows = []
            with httpx.Client(timeout=60) as client:
                for stream in (False, True):
                    for _ in range(20):  # warm both paths' connections and code
                        timed(client, engine, stream, args.max_tokens)
                        timed(client, gateway, stream, args.max_tokens)
                    direct, via = [], []
                    for _ in range(args.requests):
                        direct.append(timed(client, engine, stream, args.max_tokens))
                        via.append(timed(client, gateway, stream, args.max_tokens))
                    rows.append((stream, direct, via))
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(60)
    print(f"\n# shoal-{args.model}, {args.requests} requests per path, one at a time, "
          f"max_tokens {args.max_tokens}, load average {os.getloadavg()[0]:.1f}")
    print("| request | direct p50 (ms) | direct p99 (ms) | gateway p50 (ms) | gateway p99 (ms) |"
          " added p50 (ms) | added p99 (ms) |")
    print("|---|---|---|---|---|---|---|")
    for stream, direct, via in rows:
        d50, d99, v50, v99 = (1e3 * pct(direct, 50), 1e3 * pct(direct, 99),
                              1e3 * pct(via, 50), 1e3 * pct(via, 99))
        what = "streamed, to first token" if stream else "non-streamed, whole answer"
        print(f"| {what} | {d50:.2f} | {d99:.2f} | {v50:.2f} | {v99:.2f} | {v50 - d50:.2f} | "
              f"{v99 - d99:.2f} |")


if __name__ == "__main__":
    main()
