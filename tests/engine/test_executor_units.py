"""The multi-rank executor's pure parts: the shared-memory ring, the rank wire, the config's
parallel layout, exit descriptions. Real processes for the ring's readers (it is an IPC)."""

from __future__ import annotations

import multiprocessing as mp
import os

import msgspec
import pytest
from shoal.engine.config import EngineConfig
from shoal.engine.core.sched_output import ModelRunnerOutput, NewRequestData, SchedulerOutput
from shoal.engine.executor import procs
from shoal.engine.executor.rank_wire import LinkMessage, NodeHello, RankFailure, StopNode
from shoal.engine.executor.shm_ring import ShmRingReader, ShmRingWriter
from shoal.engine.executor.worker_proc import ARG_TYPES, raised_in_collective
from shoal.engine.wire import SamplingParams


def _read_all(handle, reader: int, count: int, out) -> None:
    ring = ShmRingReader(handle, reader)
    out.put([ring.read(timeout=30) for _ in range(count)])
    ring.close()


@pytest.mark.process  # a child process
def test_every_reader_of_the_ring_gets_every_message_in_order_even_past_a_slot():
    writer = ShmRingWriter(num_readers=2, slots=4, chunk_bytes=64)
    messages = [bytes([i]) * n for i, n in enumerate([1, 0, 64, 65, 300, 7] * 4)]
    out = mp.get_context("spawn").Queue()
    readers = [mp.get_context("spawn").Process(target=_read_all,
                                               args=(writer.handle, r, len(messages), out))
               for r in range(2)]
    for p in readers:
        p.start()
    try:
        for m in messages:  # 24 messages through 4 slots: the writer waits for both readers
            writer.write(m, timeout=30)
        got = [out.get(timeout=60) for _ in readers]
    finally:
        for p in readers:
            p.join(30)
        writer.close()
    assert got == [messages, messages]


def test_a_reader_times_out_with_none_and_a_stalled_reader_stops_the_writer():
    writer = ShmRingWriter(num_readers=1, slots=2, chunk_bytes=16)
    reader = ShmRingReader(writer.handle, 0)
    try:
        assert reader.read(timeout=0.05) is None
        writer.write(b"a", timeout=1)
        writer.write(b"b", timeout=1)
        with pytest.raises(TimeoutError, match="has not read slot"):
            writer.write(b"c", timeout=0.1)
        assert reader.read(timeout=1) == b"a"
        writer.write(b"c", timeout=1)
        assert [reader.read(timeout=1), reader.read(timeout=1)] == [b"b", b"c"]
    finally:
        reader.close()
        writer.close()


def test_a_step_crosses_the_rank_wire_typed():
    step = SchedulerOutput(
        req_ids=["r1"], token_ids=[[5, 6]], start_positions=[0], block_ids=[[1, 2]],
        sample=[True], new_requests=[NewRequestData("r1", [5, 6], SamplingParams(seed=3), 2)],
        finished_req_ids={"r0"}, total_num_scheduled_tokens=2)
    raw = msgspec.msgpack.encode([step])
    assert msgspec.msgpack.decode(raw, type=ARG_TYPES["execute_model"]) == (step,)
    out = msgspec.msgpack.decode(msgspec.msgpack.encode(ModelRunnerOutput({"r1": 9})),
                                 type=ModelRunnerOutput)
    assert out.sampled == {"r1": 9}


def test_link_messages_are_a_tagged_union():
    dec = msgspec.msgpack.Decoder(LinkMessage)
    failure = RankFailure(1, 1, "Worker_rank1", 7, "h", "ProcessExit", "killed", exit_code=-9)
    for msg in (NodeHello(1, 7, "h", 1, "0.1.0", [2, 3]), StopNode("dead", 1, failure)):
        assert dec.decode(msgspec.msgpack.encode(msg)) == msg
    assert "Worker_rank1 (rank 1, node 1, pid 7 on h)" in failure.describe()


def test_a_failure_inside_torch_distributed_is_marked_as_a_probable_consequence():
    import torch.distributed as dist

    try:
        dist.all_reduce(None)  # no process group: raises from torch.distributed's own code
    except Exception as exc:  # noqa: BLE001
        assert raised_in_collective(exc)
    try:
        raise RuntimeError("all_reduce failed")  # the message does not matter, the frames do
    except RuntimeError as exc:
        assert not raised_in_collective(exc)


@pytest.mark.parametrize("tp,nnodes,node,ranks", [(1, 1, 0, [0]), (2, 1, 0, [0, 1]),
                                                  (4, 2, 0, [0, 1]), (4, 2, 1, [2, 3])])
def test_ranks_are_spread_evenly_over_nodes(tiny_model, tp, nnodes, node, ranks):
    cfg = EngineConfig(model=tiny_model, tensor_parallel_size=tp, nnodes=nnodes, node_rank=node)
    assert list(cfg.local_ranks()) == ranks and cfg.world_size == tp


@pytest.mark.parametrize("fields,message", [
    (dict(tensor_parallel_size=3, nnodes=2), "does not split evenly over nnodes 2"),
    (dict(tensor_parallel_size=2, nnodes=2, node_rank=2), "node_rank 2 is outside"),
    (dict(master_port=65535), "master_port must be in"),
    (dict(tensor_parallel_size=0), "must be at least 1"),
])
def test_bad_parallel_layouts_are_refused_naming_the_numbers(tiny_model, fields, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model=tiny_model, **fields)


def test_exits_are_described_by_signal_or_code():
    assert procs.describe_exit(-9) == "was killed by SIGKILL (possibly the kernel's OOM killer)"
    assert procs.describe_exit(-15) == "was killed by SIGTERM"
    assert procs.describe_exit(3) == "exited with code 3"


def test_an_unreadable_model_file_is_a_start_up_fault_not_a_missing_model(tmp_path,
                                                                          monkeypatch):
    from shoal.contract.termination import Cause, is_permanent
    from shoal.engine import wire
    from shoal.engine.config import check_model_readable
    from shoal.engine.core.engine_core_proc.death import death_cause

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"x")
    check_model_readable(str(tmp_path))  # readable: nothing to say
    real_access = os.access
    # The suite runs as root, who reads any file: the OS's answer for uid 10001 is simulated.
    monkeypatch.setattr(os, "access", lambda p, mode: not str(p).endswith(".safetensors")
                        and real_access(p, mode))
    with pytest.raises(PermissionError, match=r"\['model.safetensors'\] .* not readable"):
        check_model_readable(str(tmp_path))
    exc = PermissionError("model files ... not readable")
    dead = wire.EngineDead("EngineCore_0", 1, 0, "PermissionError", str(exc),
                           cause=death_cause(exc, serving=False).value)
    cause = death_cause(serving=True, exc_type=dead.exc_type, stated=dead.cause)
    assert cause == Cause.STARTUP_ERROR and not is_permanent(Cause.STARTUP_ERROR)
