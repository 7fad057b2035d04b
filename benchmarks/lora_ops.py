"""LoRA's per-step torch op counts: what the engine dispatches per step for the base model alone,
one adapter and 8 distinct adapters (round-robin over the requests), counted with a
TorchDispatchMode around the model runner's step on the CPU. Deterministic, unlike CPU timings
on a shared machine: on a GPU each counted op that is not a view is one kernel launch (or one
copy), so the counts say how much host work LoRA adds per step where the engine is host-bound.

    .venv/bin/python benchmarks/lora_ops.py [--model tiny|small|large|PATH] [--requests 64]
        [--dtype float16] [--verbose]

--dtype float16 (the default) keeps the CPU backend's packed linears and fused norms off (they
take float32 and bfloat16), so every op is torch's and transformers' own, as on a GPU.

Per step kind (the first step, a prefill of every prompt, and a decode step of every request;
the adapters already in their device slots):
ops that are not views ("kernels"), and among them the ones building the step's index/mask
tensors (arange, cat, index copies) and the host-to-device-like copies; then the ops LoRA adds
per wrapped projection.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from benchmarks.lora import ADAPTERS, RANK, kv_budget, model_path  # noqa: E402


class Count(TorchDispatchMode):
    """Counts every aten op dispatched inside, views apart (an op that may alias, as `to` or
    `reshape`, counts when its result is new memory: a copy)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        first = args[0] if args else None
        if (func.is_view and isinstance(out, torch.Tensor) and isinstance(first, torch.Tensor)
                and out.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()):
            self.views += 1
        else:
            self.ops[func.overloadpacket.__name__] += 1
        return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--verbose", action="store_true", help="the op names of each decode step")
    args = ap.parse_args()
    from shoal.engine import wire
    from shoal.engine.llm import LLM
    from shoal.engine.lora.request import LoRARequest

    from tests.engine import lora_peft

    torch.set_num_threads(2)
    path = model_path(args.model)
    d = Path(tempfile.mkdtemp(prefix="shoal-lora-ops-"))
    atexit.register(shutil.rmtree, d, True)  # the adapters: 300+ MiB a run
    paths = lora_peft.make_adapters(path, [(d / f"a{i}", 100 + i) for i in range(ADAPTERS)],
                                    r=RANK)
    llm = LLM(path, dtype=args.dtype, device="cpu", enable_lora=True, max_loras=ADAPTERS,
              max_lora_rank=RANK, max_num_seqs=args.requests,
              kv_cache_memory_bytes=kv_budget(path, args.requests * (args.prompt_len + 32)),
              max_model_len=512, num_threads=2)
    runner = llm.engine_core.model_executor.worker.model_runner
    wrapped = len(runner.lora.layers)
    steps: list[Count] = []
    original = runner.execute_model

    def counted(sched):
        with Count() as c:
            out = original(sched)
        steps.append(c)
        return out

    runner.execute_model = counted
    vocab = 8192
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, vocab, (args.prompt_len,), generator=gen).tolist()
               for _ in range(args.requests)]
    sp = wire.SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    rows = {}
    for k in (0, 1, ADAPTERS):
        loras = [None if k == 0 else LoRARequest(f"a{i % k}", i % k + 1, paths[i % k])
                 for i in range(args.requests)]
        llm.generate(prompts[:ADAPTERS], sp, lora_request=loras[:ADAPTERS])  # slots filled
        llm.engine_core.reset_prefix_cache()
        steps.clear()
        llm.generate(prompts, sp, lora_request=loras)
        prefill, decode = steps[0], steps[-1]
        rows[k] = (prefill, decode)
        if args.verbose:
            print(f"{k} adapters, decode step: {sorted(decode.ops.items())}")
            print(f"{k} adapters, first step: {sorted(prefill.ops.items())}")
    llm.shutdown()

    def kernels(c: Count) -> int:
        return sum(c.ops.values())

    def building(c: Count) -> int:
        return sum(c.ops[n] for n in ("arange", "cat", "index_put_", "fill_", "full", "eq"))

    print(f"model {Path(path).name}, {args.dtype}, {args.requests} requests, prompts of "
          f"{args.prompt_len}, rank {RANK} on all seven projections ({wrapped} wrapped), "
          f"torch {torch.__version__}; non-view aten ops per step (views apart)")
    print("| adapters | prefill ops | decode ops | decode: LoRA's extra ops | per wrapped "
          "projection | decode: arange/cat/fill/eq | decode: mm/matmul |")
    print("|---|---|---|---|---|---|---|")
    base = kernels(rows[0][1])
    for k, (prefill, decode) in rows.items():
        extra = kernels(decode) - base
        gemms = decode.ops["mm"] + decode.ops["matmul"]
        print(f"| {k or 'base only'} | {kernels(prefill)} | {kernels(decode)} | {extra} | "
              f"{extra / wrapped:.2f} | {building(decode)} | {gemms} |")


if __name__ == "__main__":
    main()
