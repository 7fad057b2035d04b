"""Wire cost of one engine step: bytes per generated token and microseconds from the scheduler
emitting a step's decode tokens to the frontend holding them, for decode batches of 1, 32, 128
and 256 requests, per-output layout (vLLM's: one struct with a 34-character request id per token)
versus shoal's columnar OutputBatch, side by side.

Both paths are timed as the engine and frontend run them, including what the scheduler builds:
- per-output: one EngineCoreOutput per token (vLLM's scheduler does this), msgpack-encode
  vLLM's EngineCoreOutputs layout (PerOutputStep below), decode it into per-request objects;
- columnar: two appends per token into StepOutput's columns (shoal's scheduler does this),
  OutputCodec.pack + encode_into a reused buffer, decode + OutputCodec.unpack (a StepOutput:
  request ids and token ids, what AsyncLLM's output handler consumes).
The last column builds per-request objects from the unpacked columns, for comparison.

    python benchmarks/wire.py [--batches 1 32 128 256] [--seconds 0.5]
"""

from __future__ import annotations

import argparse
import time

import msgspec
from shoal.engine import wire
from shoal.engine.codec import MsgpackDecoder, MsgpackEncoder, OutputCodec
from shoal.engine.core.sched_output import StepOutput


class PerOutputStep(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's EngineCoreOutputs layout: every output whole, with its request id."""

    engine_index: int = 0
    outputs: list[wire.EngineCoreOutput] = []
    scheduler_stats: wire.SchedulerStats | None = None
    timestamp: float = 0.0


def make_step(batch: int) -> tuple[list[str], list[int], wire.SchedulerStats]:
    """One decode step: `batch` requests with OpenAI-style ids, one new token each."""
    ids = [f"chatcmpl-{i:016x}-{(i * 2654435761) % 16**8:08x}" for i in range(batch)]
    tokens = [(i * 7919) % 8192 for i in range(batch)]
    return ids, tokens, wire.SchedulerStats(batch, 0, 0.42, 0, 0, 0, 123456)


def _time_per_call(fn, seconds: float) -> float:
    n, start = 0, time.perf_counter()
    deadline = start + seconds
    while True:
        for _ in range(20):
            fn()
        n += 20
        now = time.perf_counter()
        if now >= deadline:
            return (now - start) / n * 1e6


def measure(batch: int, seconds: float) -> dict:
    ids, tokens, stats = make_step(batch)
    handles = {rid: i for i, rid in enumerate(ids)}
    id_of = {h: rid for rid, h in handles.items()}
    pairs = list(zip(ids, tokens, strict=True))

    def emit_per_output() -> PerOutputStep:
        outputs = []
        for rid, tok in pairs:
            outputs.append(wire.EngineCoreOutput(rid, [tok]))
        return PerOutputStep(outputs=outputs, scheduler_stats=stats)

    def emit_columns() -> StepOutput:
        step = StepOutput(scheduler_stats=stats)
        rids, toks = step.decode_req_ids, step.decode_token_ids
        for rid, tok in pairs:
            rids.append(rid)
            toks.append(tok)
        return step

    per_enc = msgspec.msgpack.Encoder()
    per_dec = msgspec.msgpack.Decoder(PerOutputStep)
    per_bytes = len(per_enc.encode(emit_per_output()))

    def per_output():
        per_dec.decode(per_enc.encode(emit_per_output()))

    enc, dec, buf = MsgpackEncoder(), MsgpackDecoder(wire.OutputBatch), bytearray()

    def pack() -> wire.OutputBatch:
        return OutputCodec.pack(emit_columns(), handles.get)

    col_bytes = len(enc.encode_into(pack(), buf)[0])

    def columnar():
        return OutputCodec.unpack(dec.decode(enc.encode_into(pack(), buf)), id_of)

    def objects(step: StepOutput) -> list[wire.EngineCoreOutput]:
        return [wire.EngineCoreOutput(r, [t])
                for r, t in zip(step.decode_req_ids, step.decode_token_ids, strict=True)]

    def columnar_objects():
        objects(columnar())

    check = objects(OutputCodec.unpack(dec.decode(enc.encode(pack())), id_of))
    assert check == emit_per_output().outputs
    return {
        "batch": batch,
        "per_bytes": per_bytes / batch, "col_bytes": col_bytes / batch,
        "per_us": _time_per_call(per_output, seconds),
        "col_us": _time_per_call(columnar, seconds),
        "obj_us": _time_per_call(columnar_objects, seconds),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128, 256])
    ap.add_argument("--seconds", type=float, default=0.5, help="timing per measurement")
    args = ap.parse_args()
    print("| batch | per-output B/token | columnar B/token | per-output us/step "
          "| columnar us/step | speed-up | columnar to objects us/step |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for b in args.batches:
        r = measure(b, args.seconds)
        print(f"| {b} | {r['per_bytes']:.1f} | {r['col_bytes']:.1f} | {r['per_us']:.1f} "
              f"| {r['col_us']:.1f} | {r['per_us'] / r['col_us']:.2f}x | {r['obj_us']:.1f} |")


if __name__ == "__main__":
    main()
