"""One worker process: joins torch.distributed, loads its shard of the model, then runs every
call of the step broadcast until told to stop.

Which object lives here: a Worker (worker/worker.py: device, model runner, KV cache), a
StepReceiver (the broadcast) and a PUSH socket to the EngineCore's reply PULL. The worker never
schedules; it runs what the EngineCore broadcasts, in order, like every other rank.

Failure: an exception in a call is replied as a RankFailure with the call's id (the EngineCore
fails the step with it; never a hang), then the worker waits to be stopped. A start-up failure is
replied with call id 0 and the process exits 1. Signals: SIGTERM and SIGINT are ignored (tini
sends SIGTERM to the whole process group in a pod, and a worker must live until the EngineCore
has drained); the parent stops a worker with the `shutdown` call, or SIGKILL; the kernel kills it
when its parent dies (procs.die_with_parent).

Run as `python -m shoal.engine.executor.worker_proc SPEC_JSON`.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import socket
import sys
import traceback

import msgspec
import zmq
from shoal.engine.core.sched_output import SchedulerOutput
from shoal.engine.executor import procs
from shoal.engine.executor.broadcast import BroadcastHandle, StepReceiver
from shoal.engine.executor.rank_wire import (
    NODE_JOIN_TIMEOUT_S,
    STARTUP_CALL_ID,
    RankFailure,
    WorkerCall,
    WorkerReply,
)
from shoal.engine.worker.cpu.cpus import engine_threads

log = logging.getLogger("shoal.engine.worker_proc")

# The calls a worker accepts, with their argument types (the broadcast is typed, not pickled).
ARG_TYPES: dict[str, type] = {
    "determine_num_kv_blocks": tuple,
    "initialize_kv_cache": tuple[int],
    "execute_model": tuple[SchedulerOutput],
    "get_vocab_size": tuple,
    "ping": tuple,
    "shutdown": tuple,
}
# Fault injection, for the tests of the death path: "RANK:STEP:MESSAGE" makes that rank raise
# RuntimeError(MESSAGE) in its STEP-th execute_model. Read only when the engine was started with
# the EngineCore's own switch (FAULT_INJECTION_ENV=1), so nothing reaches it by accident.
FAULT_INJECTION_ENV = "SHOAL_ENABLE_FAULT_INJECTION"
WORKER_FAULT_ENV = "SHOAL_WORKER_FAULT"
TRACEBACK_TAIL_BYTES = 2000


class WorkerProcSpec(msgspec.Struct, forbid_unknown_fields=True):
    """What the parent tells a new worker (JSON on argv)."""

    config: dict  # EngineConfig fields
    rank: int  # global rank in the tensor-parallel group
    local_reader: int  # this worker's reader index in the node's shared-memory ring
    node_rank: int
    broadcast: BroadcastHandle
    reply_address: str
    dist_init_method: str  # tcp://HOST:PORT of torch.distributed's store (rank 0 hosts it)
    parent_pid: int
    num_threads: int
    log_level: str = "INFO"


def local_worker_specs(config, broadcast: BroadcastHandle, reply_address: str,
                       dist_init_method: str) -> list[WorkerProcSpec]:
    """The specs of this node's workers (config.node_rank), children of this process. Each
    takes usable CPUs / local ranks torch threads unless config.num_threads says otherwise."""
    import dataclasses

    ranks = list(config.local_ranks())
    threads = config.num_threads or engine_threads(len(ranks))
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
              if f.name not in ("architectures", "model_max_len")}  # derived: recomputed
    return [WorkerProcSpec(config=fields, rank=rank, local_reader=reader,
                           node_rank=config.node_rank, broadcast=broadcast,
                           reply_address=reply_address, dist_init_method=dist_init_method,
                           parent_pid=os.getpid(), num_threads=threads,
                           log_level=logging.getLevelName(logging.getLogger().level))
            for reader, rank in enumerate(ranks)]


def raised_in_collective(exc: BaseException) -> bool:
    """Whether the exception came out of torch.distributed's code (by the frames it passed
    through, not by its message)."""
    marker = os.sep + os.path.join("torch", "distributed") + os.sep
    return any(marker in frame.filename for frame in traceback.extract_tb(exc.__traceback__))


def rank_failure(exc: BaseException, rank: int, node_rank: int, serving: bool) -> RankFailure:
    from shoal.engine.core.engine_core_proc.death import death_cause

    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return RankFailure(rank=rank, node_rank=node_rank, process=f"Worker_rank{rank}",
                       pid=os.getpid(), hostname=socket.gethostname(),
                       exc_type=type(exc).__name__, message=str(exc) or repr(exc),
                       traceback=tb[-TRACEBACK_TAIL_BYTES:],
                       in_collective=raised_in_collective(exc),
                       cause=death_cause(exc, serving=serving).value)


class WorkerProc:
    def __init__(self, spec: WorkerProcSpec) -> None:
        self.spec = spec
        self.rank = spec.rank
        self.worker = None
        self.serving = False  # a step ran: failures from here on are not start-up failures
        self.fault_after: int | None = None  # steps until an armed test fault fires
        self.fault_message = ""
        self._arm_fault(os.environ.get(WORKER_FAULT_ENV, ""))
        self.ctx = zmq.Context.instance()
        self.replies = self.ctx.socket(zmq.PUSH)
        self.replies.setsockopt(zmq.LINGER, 5000)
        self.replies.connect(spec.reply_address)

    def run(self) -> int:
        try:
            self.receiver = StepReceiver(self.spec.broadcast, self.spec.local_reader)
            self._start()
        except BaseException as exc:  # noqa: BLE001 - every start-up failure is reported
            failure = rank_failure(exc, self.rank, self.spec.node_rank, serving=False)
            log.error("rank %d: start-up failed: %s", self.rank, failure.describe())
            self._reply(STARTUP_CALL_ID, failure=failure)
            self.replies.close(linger=5000)
            return 1
        self._reply(STARTUP_CALL_ID, result=msgspec.msgpack.encode("ready"))
        return self._loop()

    def _start(self) -> None:
        import torch
        import torch.distributed as dist
        from shoal.engine.config import EngineConfig
        from shoal.engine.worker.worker import Worker

        spec = self.spec
        torch.set_num_threads(spec.num_threads)
        config = EngineConfig(**spec.config)
        if config.world_size > 1 and config.device in ("cuda", "auto") \
                and torch.cuda.is_available():  # one device per local rank
            config = config.replace(device=f"cuda:{spec.local_reader}")
        backend = "nccl" if config.device.startswith("cuda") else "gloo"
        log.info("rank %d: joining torch.distributed (%s, world %d) at %s", self.rank, backend,
                 config.world_size, spec.dist_init_method)
        dist.init_process_group(backend, init_method=spec.dist_init_method, rank=self.rank,
                                world_size=config.world_size,
                                timeout=datetime.timedelta(seconds=NODE_JOIN_TIMEOUT_S))
        self.worker = Worker(config, rank=self.rank)
        self.worker.init_device()
        self.worker.load_model()
        log.info("rank %d: ready (%d threads)", self.rank, spec.num_threads)

    def _loop(self) -> int:
        decoder = msgspec.msgpack.Decoder(WorkerCall)
        encoder = msgspec.msgpack.Encoder()
        while True:
            call = decoder.decode(self.receiver.recv())
            if call.method == "shutdown":
                log.info("rank %d: shutting down", self.rank)
                self._reply(call.call_id, result=encoder.encode(None))
                self.replies.close(linger=2000)
                return 0
            self.serving = self.serving or call.method == "execute_model"
            try:
                result = self._call(call)
            except Exception as exc:  # noqa: BLE001 - the EngineCore fails the step with it
                failure = rank_failure(exc, self.rank, self.spec.node_rank, self.serving)
                log.error("rank %d: %s failed: %s", self.rank, call.method, failure.describe())
                self._reply(call.call_id, failure=failure)
                continue
            if call.reply_rank in (-1, self.rank):
                self._reply(call.call_id, result=encoder.encode(result))

    def _call(self, call: WorkerCall):
        arg_type = ARG_TYPES.get(call.method)
        if arg_type is None:
            raise ValueError(f"unknown worker call {call.method!r}; allowed: {sorted(ARG_TYPES)}")
        args = msgspec.msgpack.decode(call.args, type=arg_type)
        if call.method == "ping":
            return "pong"
        if call.method == "execute_model" and self.fault_after is not None:
            self.fault_after -= 1
            if self.fault_after <= 0:
                self.fault_after = None
                raise RuntimeError(self.fault_message)
        return getattr(self.worker, call.method)(*args)

    def _arm_fault(self, plan: str) -> None:
        if not plan or os.environ.get(FAULT_INJECTION_ENV) != "1":
            return
        rank, steps, message = plan.split(":", 2)
        if int(rank) == self.rank:
            self.fault_after, self.fault_message = max(1, int(steps)), message
            log.warning("rank %d: fault injection armed: step %s raises %r", self.rank, steps,
                        message)

    def _reply(self, call_id: int, result: bytes | None = None,
               failure: RankFailure | None = None) -> None:
        reply = WorkerReply(call_id, self.rank, failure=failure)
        if result is not None:
            reply.result = msgspec.Raw(result)
        self.replies.send(msgspec.msgpack.encode(reply))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = msgspec.json.decode(argv[0], type=WorkerProcSpec)
    procs.die_with_parent(spec.parent_pid)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=spec.log_level, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s [rank {spec.rank} %(process)d] "
                               "%(message)s")
    return WorkerProc(spec).run()


if __name__ == "__main__":
    sys.exit(main())
