"""The wire protocol: every struct round-trips, the columnar batch is lossless, arrays travel
inline or as zero-copy frames, and a fixed byte vector pins the decode-batch layout (ABI)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from shoal.engine import codec, wire
from shoal.engine.codec import MsgpackDecoder, MsgpackEncoder, OutputCodec
from shoal.engine.core.sched_output import StepOutput

SP = wire.SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=3, stop=["\n\n"],
                         stop_token_ids=[2], max_tokens=32, ignore_eos=True)

EVERY_STRUCT = [
    SP,
    wire.EngineCoreRequest("req-1", [1, 2, 3], SP, 1700000000.5, eos_token_id=1, wire_handle=7),
    wire.EngineCoreRequest("req-2", [4], SP, 1.5, wire_handle=8, priority=-2),
    wire.EngineCoreOutput("req-1", [5], wire.FinishReason.STOP, stop_reason=2,
                          num_cached_tokens=16),
    wire.SchedulerStats(3, 4, 0.25, 64, 32, 1, 99),
    wire.UtilityOutput(5, None, msgspec.msgpack.encode({"num_free_blocks": 3})),
    wire.UtilityOutput(6, "ValueError: nope"),
    wire.OutputBatch(0, 2, 2, b"\x01\x00", b"\x05\x00", [wire.EngineCoreOutput("", [1])], [3],
                     wire.SchedulerStats(1), 12.5, None, ["a"],
                     [wire.RequestRejected("b", 503, "draining")]),
    wire.RequestRejected("x", 400, "bad"),
    wire.EngineHello(wire.PROTOCOL_VERSION, "0.1.0", 123, "host", 0, 0),
    wire.HandshakeAck(wire.PROTOCOL_VERSION, "0.1.0", False, "mismatch"),
    wire.EngineReady(wire.PROTOCOL_VERSION, "0.1.0", 2048, 100, 16, "float32", 256, 2048,
                     model="m", vocab_size=8192, startup_seconds=1.5),
    wire.UtilityCall(9, "get_kv_stats", [1, "a"]),
    wire.EngineDead("EngineCore_0", 42, 0, "RuntimeError", "boom", "Traceback...", "h"),
    wire.EngineStopped(42, "drain", 3),
]


@pytest.mark.parametrize("obj", EVERY_STRUCT, ids=lambda o: type(o).__name__)
def test_every_struct_round_trips(obj):
    frames = MsgpackEncoder().encode(obj)
    back = MsgpackDecoder(type(obj)).decode(frames)
    assert back == obj


def test_request_type_tags_are_single_bytes_and_stable():
    assert {t.name: t.value for t in wire.RequestType} == {
        "ADD": b"\x00", "ABORT": b"\x01", "UTILITY": b"\x03", "EXECUTOR_FAILED": b"\x04",
        "HANDSHAKE": b"\x06"}  # b"\x05" was WAKEUP (engine-internal, never sent): not reused
    assert [int(r) for r in wire.FinishReason] == [0, 1, 2, 3]


# The decode batch of two requests (handles 1 and 2, tokens 100 and 7000) with scheduler stats
# and a fixed timestamp. If this changes, the wire ABI changed: bump PROTOCOL_VERSION and say why.
# msgspec writes trailing defaults of array-like structs, so an APPENDED field shows up here too
# (both sides still decode the other's bytes); SchedulerStats is 10 fields (first_scheduled and
# the two appended LoRA fields: c0 each).
DECODE_BATCH_VECTOR = bytes.fromhex(
    "9c000202c40401000200c4046400581b90909a0200cb3fe000000000000000000009c0c0c0"
    "cb405ee00000000000c0c0c0")


def _decode_step() -> StepOutput:
    return StepOutput(["a", "b"], [100, 7000],
                      scheduler_stats=wire.SchedulerStats(num_running_reqs=2, kv_cache_usage=0.5,
                                                          step_counter=9),
                      timestamp=123.5)


def _per_request(step: StepOutput) -> list[wire.EngineCoreOutput]:
    """One output per request (the decode columns as one-token outputs): what is compared."""
    return [wire.EngineCoreOutput(r, [t]) for r, t in
            zip(step.decode_req_ids, step.decode_token_ids, strict=True)
            if r is not None] + step.outputs


def _step_of(outputs: list[wire.EngineCoreOutput], **fields) -> StepOutput:
    """A step as the scheduler makes it: plain one-token outputs in the columns, others whole."""
    step = StepOutput(**fields)
    for o in outputs:
        if len(o.new_token_ids) == 1 and o == wire.EngineCoreOutput(o.request_id,
                                                                    o.new_token_ids):
            step.decode_req_ids.append(o.request_id)
            step.decode_token_ids.append(o.new_token_ids[0])
        else:
            step.outputs.append(o)
    return step


def test_engine_step_columns_pack_to_the_fixed_byte_vector():
    """What the engine process sends (a step's decode columns, never per-token objects)."""
    batch = OutputCodec.pack(_decode_step(), {"a": 1, "b": 2}.get)
    assert msgspec.msgpack.encode(batch) == DECODE_BATCH_VECTOR


def test_a_decode_column_entry_without_a_handle_travels_whole_by_id():
    batch = OutputCodec.pack(StepOutput(["h", "x"], [1, 2]), {"h": 9}.get)
    assert batch.extra_handles == [-1]
    back = OutputCodec.unpack(MsgpackDecoder(wire.OutputBatch).decode(
        MsgpackEncoder().encode(batch)), {9: "h"})
    assert sorted(_per_request(back), key=lambda o: o.request_id) == [
        wire.EngineCoreOutput("h", [1]), wire.EngineCoreOutput("x", [2])]


def test_fixed_byte_vector_decodes_to_the_same_outputs():
    batch = msgspec.msgpack.decode(DECODE_BATCH_VECTOR, type=wire.OutputBatch)
    outs = OutputCodec.unpack(batch, {1: "a", 2: "b"})
    assert _per_request(outs) == _per_request(_decode_step())
    assert outs.scheduler_stats.kv_cache_usage == 0.5 and outs.timestamp == 123.5


def test_per_output_request_vector_is_stable():
    # EngineCoreOutput's own positional layout (request_id, new_token_ids, finish_reason, ...).
    # msgspec writes every field of an array_like struct, so an appended field grows the array
    # (0x95 -> 0x97: new_logprobs, new_prompt_logprobs) and the fields before it keep their bytes.
    out = wire.EngineCoreOutput("req-1", [42], finish_reason=wire.FinishReason.LENGTH)
    assert msgspec.msgpack.encode(out).hex() == "97a57265712d31912a01c000c0c0"
    # Append-only: the bytes of a peer from before the append still decode to the same output.
    old = bytes.fromhex("95a57265712d31912a01c000")
    assert msgspec.msgpack.decode(old, type=wire.EngineCoreOutput) == out


def test_engine_core_request_appends_priority_and_keeps_the_older_layout():
    # [request_id, prompt_token_ids, sampling_params, arrival_time, eos_token_id, wire_handle,
    # priority, lora]: priority (vLLM's) was appended (0x96 -> 0x97), then the LoRA request
    # (0x98, None: c0); the rest keeps its bytes.
    sp = wire.SamplingParams()
    req = wire.EngineCoreRequest("r", [7], sp, 2.0, eos_token_id=1, wire_handle=3, priority=4)
    sp_hex = msgspec.msgpack.encode(sp).hex()
    assert msgspec.msgpack.encode(req).hex() == f"98a1729107{sp_hex}cb4000000000000000010304c0"
    # A frontend from before the append sends six fields: the request decodes with priority 0.
    old = bytes.fromhex(f"96a1729107{sp_hex}cb40000000000000000103")
    assert msgspec.msgpack.decode(old, type=wire.EngineCoreRequest) == msgspec.structs.replace(
        req, priority=0)


def test_columnar_batch_keeps_everything_that_is_not_a_plain_decode():
    outs = [
        wire.EngineCoreOutput("plain", [70000]),  # a token id above 16 bits: 4-byte column
        wire.EngineCoreOutput("first", [3], num_cached_tokens=16),
        wire.EngineCoreOutput("done", [4], wire.FinishReason.STOP, stop_reason=4),
        wire.EngineCoreOutput("multi", [5, 6]),
        wire.EngineCoreOutput("nohandle", [7]),
    ]
    handles = {"plain": 100000, "first": 1, "done": 2, "multi": 3}
    batch = OutputCodec.pack(_step_of(outs), handles.get)
    assert batch.handle_width == 4 and batch.token_width == 4
    wire_bytes = MsgpackEncoder().encode(batch)
    back = OutputCodec.unpack(MsgpackDecoder(wire.OutputBatch).decode(wire_bytes),
                              {h: r for r, h in handles.items()})
    key = lambda o: o.request_id  # noqa: E731
    assert sorted(_per_request(back), key=key) == sorted(outs, key=key)
    assert back.finished_requests == ["done"]


def test_outputs_of_unknown_handles_are_dropped_not_misattributed():
    outs = [wire.EngineCoreOutput("gone", [1]), wire.EngineCoreOutput("live", [2])]
    batch = OutputCodec.pack(_step_of(outs), {"gone": 5, "live": 6}.get)
    back = OutputCodec.unpack(batch, {6: "live"})
    assert [o.request_id for o in _per_request(back)] == ["live"]


def test_columnar_layout_is_at_most_12_bytes_per_token_at_batch_128():
    outs = [wire.EngineCoreOutput(f"chatcmpl-{i:016x}-abcdef12", [5000 + i]) for i in range(128)]
    stats = wire.SchedulerStats(128, 0, 0.5, 0, 0, 0, 1000)
    handles = {o.request_id: i for i, o in enumerate(outs)}
    step = _step_of(outs, scheduler_stats=stats)
    columnar = len(MsgpackEncoder().encode(OutputCodec.pack(step, handles.get))[0])
    per_output = len(msgspec.msgpack.encode([outs, stats]))  # one struct per token, with its id
    assert columnar / 128 <= 12, columnar / 128
    assert per_output / 128 > 40  # what the columnar layout saves: the ~34-byte id per token


@pytest.mark.parametrize("nbytes", [16, 4096])
def test_numpy_arrays_travel_inline_below_the_threshold_and_as_frames_above(nbytes):
    class Carrier(msgspec.Struct, array_like=True):
        name: str
        values: np.ndarray

    arr = np.arange(nbytes // 4, dtype=np.float32).reshape(-1, 2)
    frames = MsgpackEncoder(size_threshold=256).encode(Carrier("x", arr))
    assert len(frames) == (1 if nbytes < 256 else 2)
    back = MsgpackDecoder(Carrier).decode(frames)
    assert back.values.dtype == np.float32 and back.values.shape == arr.shape
    assert np.array_equal(back.values, arr)
    if nbytes >= 256:  # zero-copy: the array is a view of the received frame
        assert not back.values.flags.owndata


def test_torch_tensors_round_trip_including_bfloat16():
    torch = pytest.importorskip("torch")

    Carrier = msgspec.defstruct("Carrier", [("small", torch.Tensor), ("big", torch.Tensor)],
                                array_like=True)

    small = torch.tensor([1, 2, 3], dtype=torch.int64)
    big = torch.randn(64, 8).to(torch.bfloat16)
    frames = MsgpackEncoder().encode(Carrier(small, big))
    assert len(frames) == 2
    back = MsgpackDecoder(Carrier).decode(frames)
    assert torch.equal(back.small, small)
    assert back.big.dtype == torch.bfloat16 and torch.equal(back.big, big)


def test_encode_into_reuses_the_callers_buffer():
    buf = bytearray()
    enc = MsgpackEncoder()
    frames = enc.encode_into(wire.UtilityCall(1, "ping"), buf)
    assert frames[0] is buf and bytes(buf) == msgspec.msgpack.encode(wire.UtilityCall(1, "ping"))


def test_objects_without_a_wire_form_are_refused_not_pickled():
    with pytest.raises(TypeError, match="no pickle"):
        MsgpackEncoder().encode({"x": object()})
    with pytest.raises(TypeError, match="no pickle"):
        MsgpackEncoder().encode(np.array([object()], dtype=object))


@pytest.mark.process  # a child process
def test_wire_and_codec_import_without_torch():
    import subprocess
    import sys

    code = ("import sys; import shoal.engine.wire, shoal.engine.codec; "
            "sys.exit(1 if 'torch' in sys.modules or 'zmq' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_protocol_version_is_announced_in_hello_and_ready():
    assert codec  # the codec module is the only encoder of these
    fields = [f.name for f in msgspec.structs.fields(wire.EngineHello)]
    assert fields[0] == "protocol_version"
    assert [f.name for f in msgspec.structs.fields(wire.EngineReady)][0] == "protocol_version"
