"""shoal serve and vLLM's OpenAI server, side by side in one sitting, with one load client.

This VM's speed drifts through the day (benchmarks/README.md), so a figure measured against
another taken hours earlier says little; this script alternates the two servers, each started
once per model and loaded `--repeat` times by serve.py's client (same prompts, same workload),
and prints one table. vLLM is whatever `--vllm-python` runs (a venv of its own; see the README for
installing vLLM's CPU build here).

    python benchmarks/side_by_side.py --vllm-python /tmp/vllm-venv/bin/python --models tiny small
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path

from prefix_routing import cpu_flags
from serve import RssSampler, launch, run

MODELS = Path(os.environ.get("SHOAL_CACHE", Path.home() / ".cache" / "shoal")) / "models"
KV = {"tiny": "1G", "small": "2G"}


def servers(model: str, args) -> dict[str, tuple[str, dict]]:
    path = MODELS / f"shoal-{model}"
    name = f"shoal-{model}"
    shoal = (f"{Path(sys.executable).parent / 'shoal'} serve {path} --host 127.0.0.1 --port 8141 "
             f"--served-model-name {name} --kv-cache-memory-bytes {KV[model]}")
    if args.shoal_threads:
        shoal += f" --num-threads {args.shoal_threads}"
    vllm = (f"{args.vllm_python} -m vllm.entrypoints.openai.api_server --model {path} "
            f"--host 127.0.0.1 --port 8142 --served-model-name {name} "
            "--disable-uvicorn-access-log")
    if args.vllm_dtype:
        vllm += f" --dtype {args.vllm_dtype}"
    kv_gib = KV[model].rstrip("G")
    return {"shoal": (shoal, {}), "vllm": (vllm, {"VLLM_CPU_KVCACHE_SPACE": kv_gib})}


def measure(system: str, command: str, env: dict, model: str, args) -> list[dict]:
    port = 8141 if system == "shoal" else 8142
    base = f"http://127.0.0.1:{port}"
    proc, startup = launch(command, base, args.startup_timeout, env)
    rows = []
    try:
        for i in range(args.repeat):
            # New prompts every run (seed = run index, the same for both servers): a repeat of
            # the same prompts would be served from the prefix cache.
            load = argparse.Namespace(
                base_url=base, model=f"shoal-{model}", api_key="EMPTY",
                num_prompts=args.num_prompts, input_len=args.input_len,
                output_len=args.output_len, request_rate=args.request_rate,
                max_concurrency=None, temperature=0.0, vocab_size=8192, min_token_id=10, seed=i)
            with RssSampler(proc.pid) as rss:
                r = asyncio.run(run(load))
            fe, en = (b - a for a, b in zip(rss.cpu_start, rss.cpu_end, strict=True))
            rows.append({**r, "system": system, "model": model, "run": i + 1,
                         "startup_s": startup, "fe_rss": rss.frontend / 2**20,
                         "en_rss": rss.engine / 2**20, "fe_cpu": fe, "en_cpu": en})
            print(f"# {system} {model} run {i + 1}: {r['output_tok_per_s']:.0f} tok/s",
                  file=sys.stderr, flush=True)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(120)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", required=True, help="python of a venv with vLLM installed")
    ap.add_argument("--models", nargs="+", choices=list(KV), default=["tiny"])
    ap.add_argument("--repeat", type=int, default=2, help="load runs per server start")
    ap.add_argument("--rounds", type=int, default=1, help="shoal, vLLM alternations per model")
    ap.add_argument("--shoal-threads", type=int, default=None,
                    help="shoal's --num-threads (default: not passed, shoal's own default, as "
                         "vLLM runs with its own defaults)")
    ap.add_argument("--vllm-dtype", default=None,
                    help="vLLM's --dtype (default: not passed, its auto), e.g. float32 to compare "
                         "like with like where shoal's auto keeps float32")
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--request-rate", type=float, default=float("inf"))
    ap.add_argument("--startup-timeout", type=float, default=600)
    args = ap.parse_args()

    rows = []
    for model in args.models:
        for _ in range(args.rounds):
            for system, (command, env) in servers(model, args).items():
                rows += measure(system, command, env, model, args)
    print("\n" + cpu_flags())
    rate = "inf" if args.request_rate == float("inf") else f"{args.request_rate:g}/s"
    print(f"\n{args.num_prompts} prompts, {args.input_len} in / {args.output_len} out, rate {rate}"
          f"; shoal --dtype auto, vLLM --dtype {args.vllm_dtype or 'auto'}")
    print("| model | server | run | output tok/s | TTFT median / p99 (ms) | ITL median / p99 (ms) "
          "| start-up to /health (s) | RSS frontend / engine (MiB) | CPU s client / frontend / "
          "engine |")
    print("|---|---|---:|---:|---|---|---:|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['system']} | {r['run']} | {r['output_tok_per_s']:,.0f} "
              f"| {r['ttft_median_ms']:,.0f} / {r['ttft_p99_ms']:,.0f} "
              f"| {r['itl_median_ms']:.1f} / {r['itl_p99_ms']:.1f} | {r['startup_s']:.1f} "
              f"| {r['fe_rss']:,.0f} / {r['en_rss']:,.0f} "
              f"| {r['client_cpu_s']:.1f} / {r['fe_cpu']:.1f} / {r['en_cpu']:.1f} |")
        if r["failed"]:
            print(f"|  | {r['failed']} failed: {r['first_error']} |")


if __name__ == "__main__":
    main()
