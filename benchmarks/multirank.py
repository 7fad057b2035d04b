"""Multi-rank layouts side by side, and how fast a killed rank reaches the clients.

    python benchmarks/multirank.py throughput --model small      # T=1 vs T=2 vs T=2 over 2 nodes
    python benchmarks/multirank.py kills --kills 20              # kill -> client error latency

`throughput`: each layout is started once (on loopback; "two nodes" are two process trees joined
over TCP, node 1 `--headless`) and loaded by serve.py's client (200 prompts x 128 in / 128 out,
rate inf by default). The all-reduce share of a decode step is estimated from a direct measurement:
two gloo ranks time the step's reductions (2 per layer, [batch, hidden] in the serving dtype) and
that time is divided by the measured ITL p50.

`kills`: a group serves 16 streams; one process is SIGKILLed (a local worker, the headless node,
or the EngineCore) and the time until every stream has received its error event is recorded.
Prints tables with the CPU's flags (benchmarks/README.md explains why they matter here).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
from serve import launch, pct, run

MODELS = Path(os.environ.get("SHOAL_CACHE", Path.home() / ".cache" / "shoal")) / "models"
SHOAL = str(Path(sys.executable).parent / "shoal")


def free_port_pair() -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue


def layouts(model: str, port: int, kv: str) -> dict[str, list[str]]:
    """Layout name -> the command lines (node 0 first)."""
    path = MODELS / f"shoal-{model}"
    base = (f"{SHOAL} serve {path} --host 127.0.0.1 --port {port} --served-model-name "
            f"shoal-{model} --kv-cache-memory-bytes {kv}")
    mp = free_port_pair()
    two = f" -tp 2 --nnodes 2 --master-addr 127.0.0.1 --master-port {mp}"
    return {
        "T=1": [base],
        "T=2, one node": [base + " -tp 2"],
        "T=2, two nodes": [base + two + " --node-rank 0",
                           f"{SHOAL} serve {path} --kv-cache-memory-bytes {kv}{two} "
                           "--node-rank 1 --headless"],
    }


def start(commands: list[str], url: str, timeout: float = 600) -> tuple[list, float]:
    helpers = [subprocess.Popen(c.split(), start_new_session=True, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL) for c in commands[1:]]
    proc, startup = launch(commands[0], url, timeout)
    return [proc, *helpers], startup


def stop(procs: list) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)


def allreduce_ms(hidden: int, layers: int, batch: int, dtype: str, reps: int = 20) -> float:
    """Median time of one step's reductions (2 per layer) between two gloo ranks, in ms."""
    code = f"""
import os, sys, time, torch, torch.distributed as dist
rank = int(sys.argv[1]); torch.set_num_threads(1)
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{free_port_pair()}", rank=rank,
                        world_size=2)
x = torch.randn({batch}, {hidden}, dtype=getattr(torch, "{dtype}"))
times = []
for _ in range({reps}):
    dist.barrier(); t = time.perf_counter()
    for _ in range({2 * layers}):
        dist.all_reduce(x)
    times.append(time.perf_counter() - t)
if rank == 0:
    times.sort(); print(times[len(times) // 2] * 1e3)
"""
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r)], stdout=subprocess.PIPE,
                              text=True) for r in range(2)]
    out = procs[0].communicate(timeout=300)[0]
    procs[1].wait(60)
    return float(out.strip())


def throughput(args) -> None:
    url = f"http://127.0.0.1:{args.port}"
    cfg = json.loads((MODELS / f"shoal-{args.model}" / "config.json").read_text())
    from shoal.engine.worker.model_runner import cpu_has_native_bf16

    dtype = "bfloat16" if cpu_has_native_bf16() else "float32"  # what --dtype auto resolves to
    rows = []
    for name, commands in layouts(args.model, args.port, args.kv).items():
        procs, startup = start(commands, url)
        try:
            load = argparse.Namespace(
                base_url=url, model=f"shoal-{args.model}", api_key="EMPTY",
                num_prompts=args.num_prompts, input_len=128, output_len=128,
                request_rate=float("inf"), max_concurrency=None, temperature=0.0,
                vocab_size=8192, min_token_id=10, seed=0)
            result = asyncio.run(run(load))
        finally:
            stop(procs)
        share = ""
        if name != "T=1":
            ar = allreduce_ms(cfg["hidden_size"], cfg["num_hidden_layers"],
                              min(args.num_prompts, 256), dtype)
            share = f"{ar:.1f} ms = {100 * ar / result['itl_median_ms']:.0f}%"
        rows.append((name, startup, result, share))
        print(f"{name}: {result['output_tok_per_s']:.0f} tok/s", file=sys.stderr)
    print(f"\n{args.model} model ({dtype}), {args.num_prompts} prompts x 128/128, rate inf; "
          f"{cpu_line()}\n")
    print("| layout | start-up (s) | output tok/s | ITL p50 (ms) | ITL p99 (ms) | TTFT p50 (ms) "
          "| all-reduce per decode step |")
    print("|---|---|---|---|---|---|---|")
    for name, startup, r, share in rows:
        print(f"| {name} | {startup:.1f} | {r['output_tok_per_s']:.0f} | "
              f"{r['itl_median_ms']:.0f} | {r['itl_p99_ms']:.0f} | {r['ttft_median_ms']:.0f} | "
              f"{share or '-'} |")


class _Streams:
    def __init__(self, url: str, n: int) -> None:
        self.errored_at: list[float | None] = [None] * n
        self.started = threading.Barrier(n + 1, timeout=600)
        body = {"model": "shoal-tiny", "prompt": "def main():", "max_tokens": 1800,
                "temperature": 0, "ignore_eos": True, "stream": True}
        self.threads = [threading.Thread(target=self._one, args=(url, body, i), daemon=True)
                        for i in range(n)]
        for t in self.threads:
            t.start()

    def _one(self, url: str, body: dict, i: int) -> None:
        first = True
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
                for line in r.iter_lines():
                    if first and line.startswith("data: "):
                        first = False
                        self.started.wait()
                    if line.startswith('data: {"error"'):
                        self.errored_at[i] = time.monotonic()
        except httpx.HTTPError:
            self.errored_at[i] = self.errored_at[i] or time.monotonic()
        finally:
            if first:
                self.started.abort()


KINDS = ("local worker", "headless node", "EngineCore")


def _victim(kind: str, procs: list) -> psutil.Process:
    if kind == "headless node":
        return psutil.Process(procs[1].pid)
    tree = psutil.Process(procs[0].pid).children(recursive=True)
    marker = "engine_core_proc" if kind == "EngineCore" else '"rank":1,'
    return next(p for p in tree if marker in " ".join(p.cmdline()))


def kills(args) -> None:
    url = f"http://127.0.0.1:{args.port}"
    results: dict[str, list[float]] = {}
    for kind in args.kinds:
        results[kind] = []
        for i in range(args.kills):
            cmds = layouts("tiny", args.port, "64M")
            commands = cmds["T=2, one node"] if kind == "local worker" else cmds["T=2, two nodes"]
            procs, _ = start(commands, url)
            try:
                streams = _Streams(url, 16)
                streams.started.wait()
                victim = _victim(kind, procs)
                killed = time.monotonic()
                victim.kill()
                for t in streams.threads:
                    t.join(120)
                lat = max((t or killed + 999) - killed for t in streams.errored_at)
                results[kind].append(lat)
                print(f"{kind} kill {i + 1}: every stream errored after {lat * 1e3:.0f} ms",
                      file=sys.stderr)
            finally:
                stop(procs)
    print(f"\nkill -9 -> every one of 16 streams has its error event, tiny model, T=2; "
          f"{cpu_line()}\n")
    print("| process killed | kills | p50 (ms) | p99 (ms) | max (ms) |")
    print("|---|---|---|---|---|")
    for kind, lats in results.items():
        print(f"| {kind} | {len(lats)} | {1e3 * statistics.median(lats):.0f} | "
              f"{1e3 * pct(lats, 99):.0f} | {1e3 * max(lats):.0f} |")


def cpu_line() -> str:
    flags = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    shown = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
    return f"{os.cpu_count()} cores, CPU flags: {' '.join(shown) or 'none of avx2/avx512'}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    t = sub.add_parser("throughput")
    t.add_argument("--model", default="small", choices=["tiny", "small"])
    t.add_argument("--num-prompts", type=int, default=200)
    t.add_argument("--kv", default="2G")
    k = sub.add_parser("kills")
    k.add_argument("--kills", type=int, default=20)
    k.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    for p in (t, k):
        p.add_argument("--port", type=int, default=8151)
    args = ap.parse_args()
    throughput(args) if args.what == "throughput" else kills(args)


if __name__ == "__main__":
    main()
