"""What KV cache events cost an engine step: decode step time with --kv-events-config off and on.

Two engines in this process (EngineCore, in-line executor, the same model and settings), one
without events and one publishing them on an ipc:// PUB socket that a subscriber thread drains
(a consumer is there, as in production). Each round gives both the same N new random prompts,
prefills them, then times `--steps` decode steps of the whole batch; the engines alternate
rounds because these machines' speed drifts. With P-token prompts and 16-token blocks every
16th decode step completes a block in every row: that step carries N BlockStored events (and
evictions once the cache is full), the others none, as in serving. Besides whole-step times, the
event work done on the engine's thread (building BlockStored / BlockRemoved, batching and
queueing) is timed directly: wrappers (no timer lives in the engine) time the functions events
touch (indexing full blocks, taking blocks, publishing) on both engines, and the difference is
the events' share, the figure that the machines' noise hides least. Encoding and sending run on
the publisher's own thread: they show only in the whole-step times. Prints the machine's CPU
flags and one table.

    PYTHONPATH=tests .venv/bin/python benchmarks/kv_events.py --num-requests 200 --rounds 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from shoal.engine.worker.cpu.cpus import omp_wait_env

OMP_ENV, OMP_WHY = omp_wait_env()  # as the engine process sets it, before torch loads OpenMP
os.environ.update(OMP_ENV)

import torch  # noqa: E402 - after the OpenMP environment is set
from prefix_routing import cpu_flags  # noqa: E402


class Timer:
    """Wall time spent inside wrapped methods while `active`."""

    def __init__(self) -> None:
        self.total = 0.0
        self.active = False

    def wrap(self, owner, attr: str) -> None:
        fn = getattr(owner, attr)

        def timed(*a, **kw):
            if not self.active:
                return fn(*a, **kw)
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.total += time.perf_counter() - t

        setattr(owner, attr, timed)


SUBSCRIBER = """
import signal, sys, zmq
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
ctx = zmq.Context(); sub = ctx.socket(zmq.SUB); sub.setsockopt(zmq.SUBSCRIBE, b"")
sub.connect(sys.argv[1]); n = size = 0
while not stop:
    if sub.poll(100):
        frames = sub.recv_multipart(); n += 1; size += len(frames[2])
print(n, size)
"""


def one_round(core, prompts, steps: int, timer: Timer, tag: str) -> tuple[float, float]:
    """Mean decode step (wall ms, and CPU ms of this process: the engine's threads and the
    publisher's) of `steps` steps once every prompt has its first token."""
    from shoal.engine import wire

    params = wire.SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        core.add_request(wire.EngineCoreRequest(rid, prompt, params, time.time(), None, 0))
    started: set[str] = set()
    while len(started) < len(ids):
        step = core.step()
        started.update(o.request_id for o in step.outputs)
        started.update(r for r in step.decode_req_ids if r is not None)
    timer.active = True
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        core.step()
    ms = (time.perf_counter() - t0) / steps * 1e3
    cpu_ms = (time.process_time() - c0) / steps * 1e3
    timer.active = False
    core.abort_requests(ids)
    return ms, cpu_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["tiny", "small"], default="tiny")
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--kv-gib", type=float, default=0.1)  # ~3,300 blocks: evicts
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()

    from shoal.engine.config import EngineConfig
    from shoal.engine.core.engine_core import EngineCore
    from support.models import ensure_model

    path = str(ensure_model(f"shoal-{args.model}", args.model))
    endpoint = f"ipc://{tempfile.mkdtemp(prefix='shoal-kv-bench-')}/pub"
    base = dict(model=path, dtype=args.dtype, kv_cache_memory_bytes=int(args.kv_gib * (1 << 30)),
                max_num_seqs=max(256, args.num_requests), max_model_len=1024)
    off = EngineCore(EngineConfig(**base))
    on = EngineCore(EngineConfig(**base, kv_events_config={"enable_kv_cache_events": True,
                                                           "endpoint": endpoint}))
    # The functions events touch, on both engines; the difference is the events' share.
    timer, base_timer = Timer(), Timer()
    for t, core in ((timer, on), (base_timer, off)):
        t.wrap(core.scheduler.kv, "_cache_full_blocks")
        t.wrap(core.scheduler.kv.pool, "get_new_blocks")
    timer.wrap(on, "_publish_kv_events")
    # The consumer is another process, so this process's CPU time is the engine's alone.
    consumer = subprocess.Popen([sys.executable, "-c", SUBSCRIBER, endpoint],
                                stdout=subprocess.PIPE, text=True)
    time.sleep(1.0)  # ZeroMQ's slow joiner

    gen = torch.Generator().manual_seed(0)
    times: dict[str, list[tuple[float, float]]] = {"off": [], "on": []}
    for r in range(args.rounds):
        prompts = torch.randint(10, 8000, (args.num_requests, args.input_len),
                                generator=gen).tolist()
        order = (("off", off), ("on", on)) if r % 2 == 0 else (("on", on), ("off", off))
        for name, core in order:
            times[name].append(one_round(core, prompts, args.steps,
                                         timer if name == "on" else base_timer, f"{name}{r}"))
    time.sleep(0.3)
    consumer.terminate()
    messages, size = consumer.communicate(timeout=30)[0].split()
    n_steps = args.rounds * args.steps
    hook_ms = (timer.total - base_timer.total) / n_steps * 1e3
    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
           for k, v in times.items()}

    print(cpu_flags())
    print(OMP_WHY)
    print(f"model shoal-{args.model}, {args.num_requests} requests x {args.input_len} prompt "
          f"tokens, {args.steps} decode steps x {args.rounds} rounds (alternating), torch "
          f"threads {torch.get_num_threads()}, KV {off.num_blocks} blocks of {off.block_size}")
    print(f"subscriber (another process) received {messages} batches, {int(size):,} bytes\n")
    print("| events | decode step wall ms (median) | wall ms by round | CPU ms per step "
          "(median) | added (wall / CPU) |")
    print("|---|---:|---|---:|---:|")
    for k, label in (("off", "off"), ("on", "on (zmq, one subscriber)")):
        rounds = " / ".join(f"{w:.1f}" for w, _ in times[k])
        added = ("" if k == "off" else f"{med['on'][0] / med['off'][0] - 1:+.1%} / "
                 f"{med['on'][1] / med['off'][1] - 1:+.1%}")
        print(f"| {label} | {med[k][0]:.2f} | {rounds} | {med[k][1]:.2f} | {added} |")
    print(f"| event work on the engine thread | {hook_ms:.3f} | | | "
          f"{hook_ms / med['off'][0]:+.2%} of a step |")
    on.shutdown()
    off.shutdown()


if __name__ == "__main__":
    main()
