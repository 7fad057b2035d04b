"""Where one engine step's time goes: schedule, input preparation, forward, sampling, output.

The engine runs in this process (EngineCore, in-line executor), so nothing but the step is timed:
N requests of P random prompt tokens are admitted and prefilled, then `--steps` decode steps of
the whole batch are timed phase by phase, each phase wrapped from the outside (no timer lives in
the engine). The prefill before them is timed as a whole (prompt tokens/s):

- schedule:  Scheduler.schedule (block allocation, the step's token lists)
- inputs:    the runner's per-step state and attention metadata (token ids, positions, slots)
- forward:   the model's forward pass (every layer, attention included), and inside it
  attention: the paged attention calls (the decode kernel or the torch path)
- sampling:  sampling metadata and the sampler
- update:    Scheduler.update_from_output (append tokens, stop checks, free finished)
- output:    packing the step into the wire's OutputBatch and msgpack-encoding it, as
             EngineCoreProc does before the output thread sends it

"other" is the rest of the step (the runner's glue). With `--torch-profile`, the top torch ops of
the timed steps are printed too. Prints one table and the machine's CPU flags.

    .venv/bin/python benchmarks/step_profile.py --model tiny --num-requests 200
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict
from contextlib import contextmanager

from shoal.engine.worker.cpu.cpus import omp_wait_env

# As the engine process does (core/engine_core_proc/proc.main), before torch loads OpenMP:
# idle OpenMP threads sleep unless this process is pinned or the environment says otherwise
# (cpus.py).
OMP_ENV, OMP_WHY = omp_wait_env()
os.environ.update(OMP_ENV)

import torch  # noqa: E402 - after the OpenMP environment is set
from prefix_routing import cpu_flags  # noqa: E402


class PhaseClock:
    """Accumulates wall time per phase while `active`; phases may nest (attention in forward)."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.active = False

    @contextmanager
    def phase(self, name: str):
        if not self.active:
            yield
            return
        t = time.perf_counter()
        try:
            yield
        finally:
            self.total[name] += time.perf_counter() - t

    def wrap(self, owner, attr: str, name: str) -> None:
        fn = getattr(owner, attr)

        def timed(*a, **kw):
            with self.phase(name):
                return fn(*a, **kw)

        setattr(owner, attr, timed)


def instrument(core, clock: PhaseClock) -> None:
    from shoal.engine.worker import model_runner, paged_attention

    runner = core.model_executor.worker.model_runner
    clock.wrap(core.scheduler, "schedule", "schedule")
    clock.wrap(core.scheduler, "update_from_output", "update")
    clock.wrap(runner, "_update_states", "inputs")
    clock.wrap(runner, "_attention_metadata", "inputs")
    clock.wrap(runner.model, "forward", "forward")
    clock.wrap(model_runner, "build_sampling_metadata", "sampling")
    clock.wrap(model_runner, "sample", "sampling")
    # Attention is reached through transformers' registry, not the module attribute.
    clock.wrap(paged_attention, "paged_attention_forward", "attention")
    paged_attention.AttentionInterface.register(paged_attention.ATTN_IMPLEMENTATION,
                                                paged_attention.paged_attention_forward)


def runner_dtype(core) -> str:
    return str(core.model_executor.worker.model_runner.dtype).removeprefix("torch.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["tiny", "small"], default="tiny")
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--torch-profile", action="store_true")
    args = ap.parse_args()

    from shoal.engine import wire
    from shoal.engine.codec import MsgpackEncoder, OutputCodec
    from shoal.engine.config import EngineConfig
    from shoal.engine.core.engine_core import EngineCore
    from support.models import ensure_model

    path = str(ensure_model(f"shoal-{args.model}", args.model))
    config = EngineConfig(model=path, dtype=args.dtype, kv_cache_memory_bytes=2 << 30,
                          max_num_seqs=max(256, args.num_requests))
    core = EngineCore(config)
    clock = PhaseClock()
    instrument(core, clock)
    encoder = MsgpackEncoder()

    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, 8000, (args.num_requests, args.input_len), generator=gen).tolist()
    params = wire.SamplingParams(temperature=0.0, max_tokens=args.steps + 8, ignore_eos=True)
    for i, ids in enumerate(prompts):
        core.add_request(wire.EngineCoreRequest(f"r{i}", ids, params, time.time(), None, i))
    handles = {f"r{i}": i for i in range(args.num_requests)}
    # Prefill until every request has its first token: from then on, each step is pure decode.
    started: set[str] = set()
    prefill_steps, t_prefill = 0, time.perf_counter()
    while len(started) < args.num_requests:
        step = core.step()
        prefill_steps += 1
        started.update(o.request_id for o in step.outputs)
        started.update(step.decode_req_ids)
    t_prefill = time.perf_counter() - t_prefill

    clock.active = True
    profiler = (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                if args.torch_profile else None)
    if profiler:
        profiler.__enter__()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        with clock.phase("step"):
            step = core.step()
            with clock.phase("output"):
                step.timestamp = time.monotonic()
                batch = OutputCodec.pack(step, handles.get)
                encoder.encode(batch)
    wall = time.perf_counter() - t0
    if profiler:
        profiler.__exit__(None, None, None)
    clock.active = False

    per = {k: v / args.steps * 1e3 for k, v in clock.total.items()}
    named = ("schedule", "inputs", "forward", "sampling", "update", "output")
    other = per["step"] - sum(per.get(k, 0.0) for k in named)
    print(cpu_flags())
    print(OMP_WHY)
    print(f"model shoal-{args.model}, dtype {runner_dtype(core)}, {args.num_requests} requests "
          f"x {args.input_len} prompt tokens, {args.steps} decode"
          f" steps, torch threads {torch.get_num_threads()}")
    print(f"prefill: {prefill_steps} steps of up to {config.max_num_batched_tokens} tokens, "
          f"{t_prefill:.2f} s = {args.num_requests * args.input_len / t_prefill:,.0f} prompt "
          "tok/s (engine only)")
    print(f"decode step: {per['step']:.2f} ms = {args.num_requests / per['step'] * 1e3:,.0f} "
          f"output tok/s (engine only; {wall:.2f} s for {args.steps} steps)\n")
    print("| phase | ms per step | share |")
    print("|---|---:|---:|")
    for k in named:
        print(f"| {k} | {per.get(k, 0.0):.2f} | {per.get(k, 0.0) / per['step']:.0%} |")
        if k == "forward":
            a = per.get("attention", 0.0)
            print(f"| &nbsp;&nbsp;of which attention | {a:.2f} | {a / per['step']:.0%} |")
    print(f"| other | {other:.2f} | {other / per['step']:.0%} |")
    if profiler:
        print()
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
