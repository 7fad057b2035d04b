"""Run in the cached vLLM venv (support.vllm_cli): encode KV event batches with vLLM 0.32's own
classes and encoder, exactly as its ZmqEventPublisher does (`msgspec.msgpack.Encoder().encode`
of a KVEventBatch), one payload file per batch.

    python kv_vllm_events.py OUT_DIR < SCENARIOS.json

SCENARIOS: {name: [batch, ...]}; a batch is {"ts": float, "events": [{"type": CLASS, field:
value, ...}]}; a block hash given as a string is hex bytes (vLLM's sha256 hashes), as a number
an int. Writes OUT_DIR/NAME/SEQ.bin. Imports only the standard library and vLLM's module.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _hash(value):
    return bytes.fromhex(value) if isinstance(value, str) else value


def main() -> int:
    import msgspec
    from vllm.distributed.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVEventBatch,
    )

    classes = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved,
               "AllBlocksCleared": AllBlocksCleared}
    out = Path(sys.argv[1])
    encoder = msgspec.msgpack.Encoder()
    for name, batches in json.load(sys.stdin).items():
        (out / name).mkdir(parents=True, exist_ok=True)
        for seq, batch in enumerate(batches):
            events = []
            for spec in batch["events"]:
                fields = dict(spec)
                cls = classes[fields.pop("type")]
                for key in ("block_hashes",):
                    if key in fields:
                        fields[key] = [_hash(h) for h in fields[key]]
                if fields.get("parent_block_hash") is not None:
                    fields["parent_block_hash"] = _hash(fields["parent_block_hash"])
                events.append(cls(**fields))
            payload = encoder.encode(KVEventBatch(ts=batch["ts"], events=events,
                                                  data_parallel_rank=0))
            (out / name / f"{seq:06d}.bin").write_bytes(payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
