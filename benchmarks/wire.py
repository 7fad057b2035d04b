"""Wire cost of one engine step: bytes per generated token and microseconds per encode+decode,
for decode batches of 1, 32, 128 and 256 requests, per-output layout (vLLM's: one struct with a
34-character request id per token) versus shoal's columnar OutputBatch, side by side.

Both paths are measured as the engine and frontend run them: per-output = msgpack-encode
EngineCoreOutputs / decode it into per-request objects; columnar = OutputCodec.to_batch +
encode_into a reused buffer / decode + OutputCodec.columns (request ids and token ids: what
AsyncLLM's output handler consumes). The last column decodes further into per-request objects
(OutputCodec.from_batch, the EngineCoreClient.get_output contract) for comparison.

    python benchmarks/wire.py [--batches 1 32 128 256] [--seconds 0.5]
"""

from __future__ import annotations

import argparse
import time

import msgspec
from shoal.engine import wire
from shoal.engine.codec import MsgpackDecoder, MsgpackEncoder, OutputCodec


def make_step(batch: int) -> tuple[wire.EngineCoreOutputs, dict[str, int]]:
    """One decode step: `batch` requests with OpenAI-style ids, one new token each."""
    ids = [f"chatcmpl-{i:016x}-{(i * 2654435761) % 16**8:08x}" for i in range(batch)]
    outs = wire.EngineCoreOutputs(
        outputs=[wire.EngineCoreOutput(rid, [(i * 7919) % 8192]) for i, rid in enumerate(ids)],
        scheduler_stats=wire.SchedulerStats(batch, 0, 0.42, 0, 0, 0, 123456))
    return outs, {rid: i for i, rid in enumerate(ids)}


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
    outs, handles = make_step(batch)
    id_of = {h: rid for rid, h in handles.items()}

    per_enc = msgspec.msgpack.Encoder()
    per_dec = msgspec.msgpack.Decoder(wire.EngineCoreOutputs)
    per_bytes = len(per_enc.encode(outs))

    def per_output():
        per_dec.decode(per_enc.encode(outs))

    enc, dec, buf = MsgpackEncoder(), MsgpackDecoder(wire.OutputBatch), bytearray()
    col_bytes = len(enc.encode_into(OutputCodec.to_batch(outs, handles.get), buf)[0])

    def columnar():
        frames = enc.encode_into(OutputCodec.to_batch(outs, handles.get), buf)
        OutputCodec.columns(dec.decode(frames), id_of)

    def columnar_objects():
        frames = enc.encode_into(OutputCodec.to_batch(outs, handles.get), buf)
        OutputCodec.from_batch(dec.decode(frames), id_of)

    check = OutputCodec.from_batch(dec.decode(enc.encode(OutputCodec.to_batch(outs, handles.get))),
                                   id_of)
    assert check.outputs == outs.outputs
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
