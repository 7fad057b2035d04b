"""Structured output's cost: output tokens/s of 64 concurrent requests without and with a JSON
schema on half of them, and the time of one schema's first compile.

Every request generates exactly `--output-len` tokens (ignore_eos; the schema's array is too
long to end sooner), so the two runs do the same model work and the difference is the grammar:
compiling it on the pool, filling the bitmask each step, applying it in the sampler, advancing
the matchers. Offline (`LLM`), sampling at temperature 1 with a seed per request.

    .venv/bin/python benchmarks/structured_output.py --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from multirank import cpu_line
from throughput import Clock, make_prompts, model_dir

# Long enough that no request reaches the grammar's end before --output-len tokens.
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "ok": {"type": "boolean"},
    "values": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9999},
               "minItems": 200, "maxItems": 200}},
    "required": ["name", "ok", "values"], "additionalProperties": False}


def first_compile_seconds(path: str, vocab: int) -> tuple[float, float]:
    """(llguidance tokenizer build, then one schema's compile) in a fresh manager."""
    from shoal.engine.structured.manager import StructuredOutputManager
    from shoal.engine.wire import StructuredOutputs

    manager = StructuredOutputManager(path, vocab, max_workers=1)
    t0 = time.perf_counter()
    manager._llg_tokenizer()
    t1 = time.perf_counter()
    manager._compile(StructuredOutputs("json", json.dumps(SCHEMA)), "bench")
    t2 = time.perf_counter()
    manager.shutdown()
    return t1 - t0, t2 - t1


def run(llm, prompts, out_len: int, constrained_every: int | None) -> tuple[Clock, int]:
    from shoal.engine.wire import SamplingParams, StructuredOutputs

    so = StructuredOutputs("json", json.dumps(SCHEMA))
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=out_len, ignore_eos=True,
                             structured_outputs=(so if constrained_every
                                                 and i % constrained_every == 0 else None))
              for i in range(len(prompts))]
    with Clock() as clock:
        outs = llm.generate(prompts, params)
    return clock, sum(len(c.token_ids) for o in outs for c in o.outputs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from shoal.engine.llm import LLM

    path = model_dir(args.size)
    llm = LLM(path, max_num_seqs=args.requests, kv_cache_memory_bytes=256 << 20,
              max_model_len=1024, dtype="float32")
    vocab = llm.client.engine_core.vocab_size
    prompts = make_prompts(args.requests, args.prompt_len, vocab)
    tok_s, compile_s = first_compile_seconds(path, vocab)
    run(llm, prompts[:4], 8, 2)  # warm-up (also builds the engine's own llguidance tokenizer)
    rows = []
    for label, every in (("no schema", None), ("JSON schema on half", 2)):
        clock, tokens = run(llm, prompts, args.output_len, every)
        rows.append((label, tokens, clock))
    llm.shutdown()
    print(f"\n{args.size} model, {args.requests} concurrent requests x {args.output_len} output "
          f"tokens, prompts of {args.prompt_len}, float32, torch threads "
          f"{torch.get_num_threads()}; {cpu_line()}; load average "
          f"{os.getloadavg()[0]:.1f}\n")
    print("| run | output tokens | wall (s) | output tok/s (wall) | CPU (s) | tok/s (CPU) |")
    print("|---|---|---|---|---|---|")
    for label, tokens, c in rows:
        print(f"| {label} | {tokens} | {c.wall:.2f} | {tokens / c.wall:.0f} | {c.cpu:.2f} | "
              f"{tokens / c.cpu:.0f} |")
    print(f"\nfirst compile: llguidance tokenizer from tokenizer.json {1e3 * tok_s:.0f} ms "
          f"(once per engine), then the schema {1e3 * compile_s:.1f} ms")


if __name__ == "__main__":
    main()
