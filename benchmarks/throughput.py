"""Offline throughput: shoal's LLM against transformers' generate on the same workload.

Workload (issue 2): N prompts of P random token ids, O output tokens each, greedy, ignore_eos.
shoal submits every prompt at once; transformers runs `generate` in batches of 32 (equal-length
prompts, so no padding) with its default attention (sdpa) and KV cache. Both run in the same
dtype (`--dtype`, float32 by default: the checkpoints' own). Prints one table row per model size:
output tokens/s of each and the ratio.

    .venv/bin/python benchmarks/throughput.py --size both
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def model_dir(size: str) -> str:
    from support.models import ensure_model

    return str(ensure_model(f"shoal-{size}", size))


def make_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # Skip the special tokens (ids 0..4) so prompts look like text.
    return torch.randint(5, vocab, (n, length), generator=gen).tolist()


class Clock:
    """Wall time and this process's CPU time: on a machine shared with other jobs the CPU time
    is the steadier figure (time spent waiting for a core is not counted)."""

    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.wall
        self.cpu = time.process_time() - self.cpu


def run_shoal(path: str, prompts, out_len: int, args) -> tuple[Clock, int]:
    from shoal.engine import wire
    from shoal.engine.llm import LLM

    llm = LLM(path, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_batched_tokens,
              kv_cache_memory_bytes=args.kv_gib * (1 << 30), max_model_len=1024,
              dtype=args.dtype)
    params = wire.SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    llm.generate(prompts[:4], wire.SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    with Clock() as clock:
        outs = llm.generate(prompts, params)
    clock.preemptions = llm.stats["num_preemptions"]
    llm.shutdown()
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == len(prompts) * out_len, produced
    return clock, produced


def run_transformers(path: str, prompts, out_len: int, batch: int,
                     dtype: str) -> tuple[Clock, int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    gen_kwargs = dict(max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False,
                      pad_token_id=model.config.pad_token_id)
    with torch.inference_mode():
        model.generate(torch.tensor(prompts[:4]), **{**gen_kwargs, "max_new_tokens": 4,
                                                     "min_new_tokens": 4})  # warm-up
        produced = 0
        with Clock() as clock:
            for i in range(0, len(prompts), batch):
                ids = torch.tensor(prompts[i:i + batch])
                out = model.generate(ids, **gen_kwargs)
                produced += (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return clock, produced


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=["tiny", "small", "both"], default="both")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--hf-batch", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-gib", type=float, default=2.0,
                        help="KV cache budget; 2 GiB holds all 200 requests of the small model "
                             "(24 KiB per token), so nothing is preempted")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for both engines (default: torch's choice)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="of both engines (shoal's `auto` would pick bfloat16 on CPUs with "
                             "native bf16, transformers' float32: a like-for-like run names one)")
    parser.add_argument("--skip-hf", action="store_true", help="only measure shoal")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = ["tiny", "small"] if args.size == "both" else [args.size]
    rows = []
    for size in sizes:
        path = model_dir(size)
        prompts = make_prompts(args.num_prompts, args.prompt_len, 8192)
        s_clock, s_tok = run_shoal(path, prompts, args.output_len, args)
        row = [size, f"{s_tok}", f"{s_clock.preemptions}", f"{s_clock.wall:.1f}",
               f"{s_tok / s_clock.wall:.0f}", f"{s_tok / s_clock.cpu:.0f}"]
        if args.skip_hf:
            row += ["-"] * 5
        else:
            h_clock, h_tok = run_transformers(path, prompts, args.output_len, args.hf_batch,
                                              args.dtype)
            row += [f"{h_clock.wall:.1f}", f"{h_tok / h_clock.wall:.0f}",
                    f"{h_tok / h_clock.cpu:.0f}",
                    f"{(s_tok / s_clock.wall) / (h_tok / h_clock.wall):.2f}x",
                    f"{(s_tok / s_clock.cpu) / (h_tok / h_clock.cpu):.2f}x"]
        rows.append(row)
        print(f"# {size}: done", file=sys.stderr, flush=True)
    header = ["model", "output tokens", "shoal preemptions", "shoal s", "shoal tok/s",
              "shoal tok/cpu-s", "hf s", f"hf tok/s (batch {args.hf_batch})", "hf tok/cpu-s",
              "ratio (wall)", "ratio (cpu)"]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print(f"workload: {args.num_prompts} prompts x {args.prompt_len} random tokens -> "
          f"{args.output_len} tokens, greedy, ignore_eos; {args.dtype}; torch threads "
          f"{torch.get_num_threads()}")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
