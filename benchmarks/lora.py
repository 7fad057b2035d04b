"""LoRA throughput: output tok/s of N concurrent greedy requests (default 64) through the
offline engine (one generate call: every request is in the batch at once) with 0 (base only),
1, 4 and 8 distinct adapters spread round-robin over the requests, against base only; and the
adapter load time (read + check into the host cache) and, separately, the copy of each into a
device slot. Adapters are made with peft on the model (rank 16, all seven projections).

    .venv/bin/python benchmarks/lora.py [--device cpu|cuda] [--model tiny|small|large|PATH]
        [--requests 64] [--max-tokens 64] [--prompt-len 32] [--threads 2] [--repeats 2]
        [--profile] [--check]

Models (`shoal make-model`, built once into $SHOAL_CACHE/models; PATH: any Llama-shaped model
directory): tiny (hidden 256, MLP 688, 4 layers, 4/2 heads), small (hidden 768, MLP 2048, 12
layers, 12/4 heads), large (Llama-3-8B's layer shape: hidden 4096, MLP 14336, 32/8 heads of
128; 8 layers; 1.8 B parameters: on a GPU its GEMMs weigh per layer what a real 8B model's do),
all with the project's 8,192-token vocabulary. The device, the torch version, the model's shape
and the dtype are printed above the table. `--profile`: a torch.profiler summary of one
generate (base only and 8 adapters): time per step, device-kernel time per step, the ops.
`--check`: first, greedy tokens with adapters in float32 against transformers + PEFT.
"""

from __future__ import annotations

import argparse
import atexit
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

MODELS = {"tiny": ("shoal-tiny", "tiny"), "small": ("shoal-small", "small"),
          "large": ("shoal-large", "large")}
RANK = 16
ADAPTERS = 8


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


def device_line(device: str, threads: int) -> str:
    versions = f"torch {torch.__version__}"
    try:
        import peft
        import transformers
        versions += f", transformers {transformers.__version__}, peft {peft.__version__}"
    except ImportError:
        pass
    if device.startswith("cuda"):
        p = torch.cuda.get_device_properties(torch.device(device))
        return (f"GPU: {p.name}, {p.total_memory / 2**30:.0f} GiB, compute capability "
                f"{p.major}.{p.minor}, {p.multi_processor_count} SMs; CUDA {torch.version.cuda}; "
                f"{versions}; host CPU: {cpu_flags().split(';')[0]}")
    return f"CPU: {cpu_flags()}; torch threads {threads}; {versions}"


def model_path(name: str) -> str:
    if name in MODELS:
        from support.models import ensure_model

        return str(ensure_model(*MODELS[name]))
    if not (Path(name) / "config.json").is_file():
        raise SystemExit(f"--model {name!r}: not one of {sorted(MODELS)} nor a model directory")
    return name


def shape_line(path: str, dtype) -> str:
    cfg = json.loads((Path(path) / "config.json").read_text())
    heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    from safetensors import safe_open

    params = 0  # from the files: the CPU backend packs the linears' weights outside parameters()
    for f in Path(path).glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            params += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    return (f"model {Path(path).name} ({', '.join(cfg.get('architectures', []))}): hidden "
            f"{cfg['hidden_size']}, MLP {cfg.get('intermediate_size')}, "
            f"{cfg['num_hidden_layers']} layers, {heads} query / {kv} KV heads of {head_dim}, "
            f"vocab {cfg['vocab_size']}, {params / 1e6:,.0f} M parameters; dtype {dtype}")


def kv_budget(path: str, tokens: int) -> int:
    """Twice the KV bytes the run needs (float32 counted), at least 256 MiB (the CPU default
    the first sittings used)."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    per_token = 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", heads) * head_dim * 4
    return max(256 << 20, 2 * tokens * per_token)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def profile(llm, prompts, loras, sp, device: str, label: str) -> None:
    """One generate under torch.profiler: per step the wall time, the device kernels' time,
    and the ops that take the time (self CPU, self device)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = device.startswith("cuda")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    llm.engine_core.reset_prefix_cache()
    steps0 = llm.stats["steps"]
    sync(device)
    with torch_profile(activities=acts) as prof:
        t = time.perf_counter()
        llm.generate(prompts, sp, lora_request=loras)
        sync(device)
        dt = time.perf_counter() - t
    steps = llm.stats["steps"] - steps0
    events = prof.key_averages()
    line = f"profile, {label}: {steps} steps, {dt / steps * 1000:.2f} ms per step (profiled)"
    if cuda:
        from torch.autograd import DeviceType

        kernels = sum(e.self_device_time_total for e in events  # kernels and copies, us -> ms
                      if e.device_type == DeviceType.CUDA) / 1000
        launches = sum(e.count for e in events if e.key in (
            "cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx"))
        line += (f"; device kernels {kernels / steps:.2f} ms per step "
                 f"({kernels / (dt * 1000):.0%} of the wall time); "
                 f"{launches / steps:.0f} kernel launches per step")
    print(line)
    print(events.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=40))
    if cuda:
        print(events.table(sort_by="self_device_time_total", row_limit=10,
                           max_name_column_width=40))


def check(path: str, paths: list[str], device: str, threads: int | None) -> None:
    """Exactness on this device: the engine's greedy tokens in float32, three adapters and the
    base in one batch (the dense form) and one adapter alone (the per-group form), against
    transformers + PEFT (PeftModel.from_pretrained, each prompt alone, float32, on the CPU)."""
    from shoal.engine import wire
    from shoal.engine.llm import LLM
    from shoal.engine.lora.request import LoRARequest

    from tests.engine import lora_peft

    n = 12
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(5, vocab, (k,), generator=gen).tolist() for k in (3, 16, 17, 40)]
    names = [0, None, 1, 2]
    llm = LLM(path, dtype="float32", device=device, enable_lora=True, max_loras=3,
              max_lora_rank=RANK, max_num_seqs=16, kv_cache_memory_bytes=kv_budget(path, 1024),
              max_model_len=512, num_threads=threads)
    sp = wire.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    req = [None if i is None else LoRARequest(f"a{i}", i + 1, paths[i]) for i in names]
    mixed = llm.generate([p for _ in names for p in prompts], sp,
                         lora_request=[r for r in req for _ in prompts])
    alone = llm.generate(prompts, sp, lora_request=req[0])
    llm.shutdown()
    got = [o.outputs[0].token_ids for o in mixed + alone]
    refs = {i: lora_peft.reference(path, None if i is None else paths[i], prompts, n)
            for i in names}
    want = [t for i in names for t in refs[i]] + refs[0]
    equal = sum(a == b for a, b in zip(got, want, strict=True))
    differ = sum(a != b for a, b in zip(refs[0], refs[None], strict=True))
    print(f"check on {device}, float32: {equal} of {len(want)} greedy sequences of {n} tokens "
          f"equal transformers + PEFT's (adapters a0, a1, a2 and the base in one batch: the "
          f"dense form; a0 alone: one group); a0 changes {differ} of {len(prompts)} outputs",
          flush=True)
    if equal != len(want):
        raise SystemExit("check failed: the engine's adapters differ from PEFT's on this device")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    ap.add_argument("--model", default="tiny", help="tiny (default), small, large or a PATH")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: 2 on the CPU, the engine's own on CUDA)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--profile", action="store_true",
                    help="after the table, a torch.profiler summary of base only and 8 adapters")
    ap.add_argument("--check", action="store_true",
                    help="first, the engine's greedy tokens with adapters in float32 on this "
                         "device against transformers + PEFT's (exits 1 if they differ)")
    args = ap.parse_args()
    from shoal.engine import wire
    from shoal.engine.llm import LLM
    from shoal.engine.lora.request import LoRARequest

    from tests.engine import lora_peft

    cuda = args.device.startswith("cuda")
    threads = args.threads or (None if cuda else 2)
    if threads:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    path = model_path(args.model)
    made = time.perf_counter() - t0
    d = Path(tempfile.mkdtemp(prefix="shoal-lora-bench-"))
    atexit.register(shutil.rmtree, d, True)  # the adapters: 300+ MiB a run
    t0 = time.perf_counter()
    paths = lora_peft.make_adapters(path, [(d / f"a{i}", 100 + i) for i in range(ADAPTERS)],
                                    r=RANK)
    print(f"model ready in {made:.1f} s, {ADAPTERS} peft adapters made in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    if args.check:
        check(path, paths, args.device, threads)
    t0 = time.perf_counter()
    llm = LLM(path, dtype=args.dtype, device=args.device, enable_lora=True,
              max_loras=ADAPTERS, max_lora_rank=RANK, max_num_seqs=args.requests,
              kv_cache_memory_bytes=kv_budget(path, args.requests * (args.prompt_len
                                                                     + args.max_tokens + 16)),
              max_model_len=max(512, args.prompt_len + args.max_tokens), num_threads=threads)
    runner = llm.engine_core.model_executor.worker.model_runner
    print(f"engine started in {time.perf_counter() - t0:.1f} s", flush=True)
    print(device_line(args.device, torch.get_num_threads()))
    print(shape_line(path, runner.dtype))
    loads, fills = [], []
    for i, p in enumerate(paths):
        t = time.perf_counter()
        llm.engine_core.add_lora(LoRARequest(f"a{i}", i + 1, p))
        loads.append(time.perf_counter() - t)
    for i, p in enumerate(paths):  # each into a free device slot (what a step's first use does)
        sync(args.device)
        t = time.perf_counter()
        runner.lora.batch([LoRARequest(f"a{i}", i + 1, p)], [1])
        sync(args.device)
        fills.append(time.perf_counter() - t)
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, vocab, (args.prompt_len,), generator=gen).tolist()
               for _ in range(args.requests)]
    sp = wire.SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:4], sp)  # warm-up

    def adapters(k: int):
        return [None] * len(prompts) if k == 0 else [
            LoRARequest(f"a{i % k}", i % k + 1, paths[i % k]) for i in range(len(prompts))]

    rows = []
    base_tps = None
    for k in (0, 1, 4, 8):
        tps, per_step = [], []
        for _ in range(args.repeats):
            llm.engine_core.reset_prefix_cache()
            steps0 = llm.stats["steps"]
            t = time.perf_counter()
            outs = llm.generate(prompts, sp, lora_request=adapters(k))
            dt = time.perf_counter() - t
            tps.append(sum(len(o.outputs[0].token_ids) for o in outs) / dt)
            per_step.append(dt / (llm.stats["steps"] - steps0))
        best = max(tps)
        base_tps = base_tps or best
        rows.append((k, best, statistics.median(tps), best / base_tps, min(per_step)))
    print(f"{args.requests} requests x {args.max_tokens} output tokens, prompts of "
          f"{args.prompt_len}, rank {RANK} on all seven projections, --max-loras {ADAPTERS}, "
          f"best of {args.repeats}")
    print("| adapters | output tok/s (best) | median | vs base | ms per step (best) |")
    print("|---|---|---|---|---|")
    for k, best, med, rel, step in rows:
        print(f"| {k or 'base only'} | {best:,.0f} | {med:,.0f} | {rel:.0%} | {step * 1000:.2f} |")
    print(f"adapter load (read + check into the host cache, rank {RANK}, "
          f"{len(runner.lora.layers)} projections): median "
          f"{statistics.median(loads) * 1000:.1f} ms, max {max(loads) * 1000:.1f} ms; "
          f"copy into a device slot: median {statistics.median(fills) * 1000:.1f} ms, "
          f"max {max(fills) * 1000:.1f} ms", flush=True)
    if args.profile:
        n = min(16, args.max_tokens)
        short = wire.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        for k in (0, ADAPTERS):
            profile(llm, prompts, adapters(k), short, args.device,
                    f"{k or 'base only'}{' adapters' if k else ''}, {n} output tokens")
    llm.shutdown()


if __name__ == "__main__":
    main()
