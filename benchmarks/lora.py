"""LoRA throughput: output tok/s of N concurrent greedy requests (default 64) through the
offline engine (one generate call: every request is in the batch at once) with 0 (base only),
1, 4 and 8 distinct adapters spread round-robin over the requests, against base only; and the
adapter load time (read + check into the host cache; the first step also copies it into a
device slot). Adapters are made with peft on the tiny model (rank 16, all seven projections).

    .venv/bin/python benchmarks/lora.py [--requests 64] [--max-tokens 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))


def cpu_flags() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines()
                  if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines()
                  if ln.startswith("flags")), [])
    keep = [f for f in flags if f.startswith(("avx", "amx")) or f in ("fma", "f16c")]
    return f"{model}; {' '.join(sorted(keep))}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    from shoal.engine import wire
    from shoal.engine.llm import LLM
    from shoal.engine.lora.request import LoRARequest
    from support.models import ensure_model

    from tests.engine import lora_peft

    torch.set_num_threads(args.threads)
    tiny = str(ensure_model("shoal-tiny", "tiny"))
    print(f"CPU: {cpu_flags()}; torch threads {args.threads}")
    d = Path(tempfile.mkdtemp(prefix="shoal-lora-bench-"))
    paths = [lora_peft.make_adapter(tiny, d / f"a{i}", 100 + i, r=16) for i in range(8)]
    llm = LLM(tiny, dtype=args.dtype, enable_lora=True, max_loras=8, max_lora_rank=16,
              max_num_seqs=args.requests, kv_cache_memory_bytes=256 << 20, max_model_len=512,
              num_threads=args.threads)
    loads = []
    for i, p in enumerate(paths):
        t = time.perf_counter()
        llm.engine_core.add_lora(LoRARequest(f"a{i}", i + 1, p))
        loads.append(time.perf_counter() - t)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 8192, (args.prompt_len,), generator=gen).tolist()
               for _ in range(args.requests)]
    sp = wire.SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:4], sp)  # warm-up
    rows = []
    base_tps = None
    for k in (0, 1, 4, 8):
        loras = [None] * len(prompts) if k == 0 else [
            LoRARequest(f"a{i % k}", i % k + 1, paths[i % k]) for i in range(len(prompts))]
        tps = []
        for _ in range(args.repeats):
            llm.engine_core.reset_prefix_cache()
            t = time.perf_counter()
            outs = llm.generate(prompts, sp, lora_request=loras)
            dt = time.perf_counter() - t
            tps.append(sum(len(o.outputs[0].token_ids) for o in outs) / dt)
        best = max(tps)
        base_tps = base_tps or best
        rows.append((k, best, statistics.median(tps), best / base_tps))
    print(f"{args.requests} requests x {args.max_tokens} output tokens, prompts of "
          f"{args.prompt_len}, dtype {llm.engine_core.model_executor.worker.model_runner.dtype}")
    print("| adapters | output tok/s (best) | median | vs base |")
    print("|---|---|---|---|")
    for k, best, med, rel in rows:
        print(f"| {k or 'base only'} | {best:,.0f} | {med:,.0f} | {rel:.0%} |")
    print(f"adapter load (read + check, rank 16, 7 projections x 4 layers): "
          f"median {statistics.median(loads) * 1000:.1f} ms, max {max(loads) * 1000:.1f} ms")
    llm.shutdown()


if __name__ == "__main__":
    main()
