"""EngineCoreProc: the engine process. EngineCore plus sockets, IO threads and lifecycle.

Which thread owns what (nothing else touches it):
- main thread: the busy loop and the EngineCore (scheduler, KV cache, model). It never touches a
  socket; it reads `input_queue` / `aborts_queue` and writes `output_queue`.
- input thread: the DEALER socket (connected to the frontend's ROUTER). Start-up handshake, then
  decodes ADD / ABORT / UTILITY frames into the queues. An ABORT goes to both queues: the busy loop
  applies aborts right after the forward pass, before outputs are built and sent.
- output thread: the PUSH socket (connected to the frontend's PULL). msgpack-encodes batches into
  reused buffers, tracked by zmq MessageTrackers until ZeroMQ is done with them.
- watchdog thread: exits the process if the frontend that started it is gone.

Lifecycle: HELLO/ACK (protocol check) -> build EngineCore (weights, KV sizing) -> READY ->
busy loop. SIGTERM: `shutdown_timeout` 0 aborts everything in flight and sends the abort outputs
before exiting 0; > 0 drains (new ADDs are rejected with 503, stepping continues until idle or the
deadline, then the rest is aborted). A fatal error sends ENGINE_CORE_DEAD with the root cause,
writes the Kubernetes termination message and exits 1.

Run as `python -m shoal.engine.engine_core_proc SPEC_JSON` (the frontend's mp_client does that).
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import socket as _socket
import sys
import threading
import time
import traceback
from collections import deque
from typing import Any

import msgspec
import zmq
from shoal.engine import __version__ as ENGINE_VERSION
from shoal.engine import wire
from shoal.engine.codec import MsgpackDecoder, MsgpackEncoder, OutputCodec
from shoal.engine.core.sched_output import StepOutput
from shoal.engine.errors import death_cause
from shoal.engine.wire import (
    PROTOCOL_VERSION,
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    RequestRejected,
    RequestType,
    UtilityCall,
    UtilityOutput,
)

logger = logging.getLogger("shoal.engine.core_proc")

# UTILITY calls may invoke EngineCore.UTILITY_METHODS plus these, answered here. Anything else
# is refused: the wire is not an arbitrary-code channel.
PROC_UTILITIES = frozenset({"ping", "get_num_unfinished_requests", "fail_for_test"})
# `fail_for_test` (raise inside the busy loop, to exercise the death path end to end) only works
# when the engine process was started with this variable set to 1; so does a worker's
# WORKER_FAULT_ENV (executor/worker_proc.py).
FAULT_INJECTION_ENV = "SHOAL_ENABLE_FAULT_INJECTION"

HANDSHAKE_TIMEOUT_S = 60.0
MAX_REUSE_BUFFERS = 4


class EngineProcSpec(msgspec.Struct, forbid_unknown_fields=True):
    """What the frontend tells a new engine process (JSON on argv)."""

    input_address: str
    output_address: str
    config: dict[str, Any]  # EngineConfig fields
    engine_index: int = 0
    rank: int = 0
    shutdown_timeout: float = 0.0
    parent_pid: int = 0
    log_level: str = "INFO"


class _Fatal(Exception):
    """Raised inside the busy loop to turn a background failure into a clean death message."""


class EngineCoreProc:
    """See the module docstring. Construct, then `run()`; `run()` returns the exit code."""

    def __init__(self, spec: EngineProcSpec) -> None:
        self.spec = spec
        self.name = f"EngineCore_{spec.engine_index}"
        self.started = time.monotonic()
        self.input_queue: queue.Queue = queue.Queue()
        self.aborts_queue: queue.Queue = queue.Queue()
        self.output_queue: queue.Queue = queue.Queue()
        self.ack_event = threading.Event()
        self.ack: wire.HandshakeAck | None = None
        self.io_error: BaseException | None = None
        self.engine_core = None
        # request_id -> wire handle of every live request (owned by the busy loop).
        self.handles: dict[str, int] = {}
        self.live: set[str] = set()
        self.pending_rejections: list[RequestRejected] = []
        self.shutdown_requested = False
        self.draining = False
        self.serving = False  # start-up finished: deaths from here on are not start-up faults
        self.ctx = zmq.Context()

    # ----- entry -------------------------------------------------------------------------------

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_sigterm)
        signal.signal(signal.SIGINT, self._on_sigterm)
        self.output_thread = threading.Thread(target=self._output_loop, name="output", daemon=True)
        self.input_thread = threading.Thread(target=self._input_loop, name="input", daemon=True)
        self.output_thread.start()
        self.input_thread.start()
        if self.spec.parent_pid:
            threading.Thread(target=self._watch_parent, name="watchdog", daemon=True).start()
        try:
            self._wait_for_ack()
            self._build_engine()
            self._send_ready()
            self.serving = True
            mode = self._busy_loop()
            return self._stop_cleanly(mode)
        except BaseException as exc:  # noqa: BLE001 - every failure must be reported
            return self._die(exc)

    def _wait_for_ack(self) -> None:
        if not self.ack_event.wait(HANDSHAKE_TIMEOUT_S):
            raise TimeoutError(f"no handshake from the frontend at {self.spec.input_address} "
                               f"within {HANDSHAKE_TIMEOUT_S:.0f} s")
        if self.io_error is not None:
            raise self.io_error
        ack = self.ack
        assert ack is not None
        if ack.protocol_version != PROTOCOL_VERSION:
            raise RuntimeError(f"wire protocol mismatch: this engine speaks v{PROTOCOL_VERSION} "
                               f"(shoal {ENGINE_VERSION}), the frontend v{ack.protocol_version} "
                               f"(shoal {ack.engine_version}); run the same shoal version on both")
        if not ack.accepted:
            raise RuntimeError(f"the frontend refused this engine: {ack.reason}")

    def _build_engine(self) -> None:
        from shoal.engine.config import EngineConfig
        from shoal.engine.core.engine_core import EngineCore

        config = EngineConfig(**self.spec.config)
        logger.info("%s: loading model %s (dtype %s, device %s)", self.name, config.model,
                    config.dtype, config.device)
        self.config = config
        self.engine_core = EngineCore(config)
        core = self.engine_core
        executor = core.model_executor
        executor.failure_callbacks.append(  # a rank failed: wake the busy loop
            lambda failure: self.input_queue.put((RequestType.EXECUTOR_FAILED, failure)))
        executor.on_shutdown_request = self._group_shutdown_requested
        logger.info("%s: KV cache %d blocks x %d tokens, max_model_len %d (%.1f s since start)",
                    self.name, core.num_blocks, core.block_size, core.max_model_len,
                    time.monotonic() - self.started)

    def _send_ready(self) -> None:
        core, cfg = self.engine_core, self.config
        ready = wire.EngineReady(
            protocol_version=PROTOCOL_VERSION,
            engine_version=ENGINE_VERSION,
            max_model_len=int(core.max_model_len),
            num_blocks=int(core.num_blocks),
            block_size=int(core.block_size),
            dtype=str(getattr(core, "dtype", cfg.dtype)).removeprefix("torch."),
            tensor_parallel_size=int(cfg.tensor_parallel_size),
            world_size=int(cfg.world_size),
            max_num_seqs=int(cfg.max_num_seqs),
            max_num_batched_tokens=int(cfg.max_num_batched_tokens),
            model=cfg.model,
            vocab_size=int(getattr(core, "vocab_size", 0) or 0),
            enable_prefix_caching=bool(cfg.enable_prefix_caching),
            startup_seconds=time.monotonic() - self.started,
        )
        self.output_queue.put(("ready", ready))

    # ----- busy loop (main thread; no sockets) --------------------------------------------------

    def _busy_loop(self) -> str:
        """Returns the shutdown mode once a requested shutdown has finished its work."""
        core = self.engine_core
        deadline = None
        busy = False
        while True:
            if self.shutdown_requested and deadline is None:
                if self.spec.shutdown_timeout <= 0:
                    return "abort"
                self.draining = True
                deadline = time.monotonic() + self.spec.shutdown_timeout
                logger.info("%s: draining %d requests (timeout %.0f s); new requests rejected",
                            self.name, len(self.live), self.spec.shutdown_timeout)
            if deadline is not None and (not core.has_unfinished_requests()
                                         or time.monotonic() >= deadline):
                self._drain_input()
                return "drain"
            self._drain_input(block=not core.has_unfinished_requests() and not busy)
            if core.has_unfinished_requests():
                step = core.step_output()
                aborted = self._apply_aborts()
                self._send_outputs(step, aborted)
                busy = True
            elif busy or self.pending_rejections:
                # Going idle: publish fresh gauges (running 0, KV usage after frees), or they
                # would show the last busy step until the next request.
                self._send_outputs(StepOutput(scheduler_stats=self.engine_core.make_stats()), set())
                busy = False

    def _drain_input(self, block: bool = False) -> None:
        """Handle everything queued; if `block`, wait (briefly, to notice signals) for one."""
        try:
            item = self.input_queue.get(timeout=0.2) if block else self.input_queue.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self.input_queue.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: RequestType, payload: Any) -> None:
        if kind == RequestType.ADD:
            self._add(payload)
        elif kind == RequestType.ABORT:
            self._abort(payload)
        elif kind == RequestType.UTILITY:
            self._utility(payload)
        elif kind == RequestType.EXECUTOR_FAILED:
            if isinstance(payload, str):
                raise _Fatal(payload)
            from shoal.engine.executor.multiproc_executor import WorkerFailedError

            raise WorkerFailedError(payload)
        # WAKEUP: nothing to do

    def _add(self, req: EngineCoreRequest) -> None:
        if self.draining:
            self._reject(req, 503, "the engine is shutting down (draining) and admits no new "
                                   "requests; retry on another replica")
            return
        try:
            self.engine_core.add_request(req)
        except ValueError as exc:
            self._reject(req, 400, str(exc))
            return
        self.live.add(req.request_id)
        if req.wire_handle is not None:
            self.handles[req.request_id] = req.wire_handle

    def _reject(self, req: EngineCoreRequest, status: int, message: str) -> None:
        logger.info("%s: rejected %s (%d): %s", self.name, req.request_id, status, message)
        self.pending_rejections.append(RequestRejected(req.request_id, status, message))

    def _abort(self, request_ids: list[str]) -> None:
        ids = [r for r in request_ids if r in self.live]
        if ids:
            self.engine_core.abort_requests(ids)
        for rid in ids:
            self.live.discard(rid)
            self.handles.pop(rid, None)

    def _apply_aborts(self) -> set[str]:
        """Aborts that arrived during the forward pass: applied before outputs are sent, so an
        aborted request's blocks are free for the next schedule and its tokens are not sent."""
        aborted: set[str] = set()
        while True:
            try:
                ids = self.aborts_queue.get_nowait()
            except queue.Empty:
                break
            aborted.update(r for r in ids if r in self.live)
            self._abort(ids)
        return aborted

    def _send_outputs(self, step: StepOutput, aborted: set[str]) -> None:
        if aborted:
            step.drop(aborted)
        rejected, self.pending_rejections = self.pending_rejections or None, []
        finished = step.finished_requests
        batch = OutputCodec.pack(step.decode_req_ids, step.decode_token_ids, step.outputs,
                                 self.handles.get, scheduler_stats=step.scheduler_stats,
                                 finished_requests=finished or None, rejected=rejected,
                                 timestamp=time.monotonic())
        for rid in finished:  # handles die with their request, after the batch names them
            self.live.discard(rid)
            self.handles.pop(rid, None)
        self.output_queue.put(("batch", batch))

    def _utility(self, call: UtilityCall) -> None:
        out = UtilityOutput(call.call_id)
        try:
            allowed = self.engine_core.UTILITY_METHODS | PROC_UTILITIES
            if call.method not in allowed:
                raise ValueError(f"utility method {call.method!r} is not allowed; allowed: "
                                 f"{sorted(allowed)}")
            if call.method == "ping":
                result: Any = "pong"
            elif call.method == "get_num_unfinished_requests":
                result = len(self.live)
            elif call.method == "fail_for_test":
                if os.environ.get(FAULT_INJECTION_ENV) != "1":
                    raise ValueError(f"fault injection is off (set {FAULT_INJECTION_ENV}=1)")
                raise RuntimeError(str(call.args[0]) if call.args else "injected fault")
            else:
                result = self.engine_core.call_utility(call.method, call.args)
            out.result = msgspec.msgpack.encode(result)
        except RuntimeError as exc:
            if call.method == "fail_for_test":
                raise
            out.failure_message = f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # noqa: BLE001 - the caller gets the reason
            out.failure_message = f"{type(exc).__name__}: {exc}"
        self.output_queue.put(("batch", wire.OutputBatch(utility_output=out)))

    # ----- shutdown and death -------------------------------------------------------------------

    def _on_sigterm(self, signum, frame) -> None:
        if self.shutdown_requested:
            return
        self.shutdown_requested = True
        logger.info("%s: received %s, shutting down (mode %s)", self.name,
                    signal.Signals(signum).name,
                    "abort" if self.spec.shutdown_timeout <= 0 else "drain")
        if self.engine_core is None:  # still starting: nothing in flight
            raise SystemExit(0)

    def _group_shutdown_requested(self, req) -> None:
        """A headless node got SIGTERM: the whole group shuts down, led from here (drain or
        abort by --shutdown-timeout), through the frontend as for a SIGTERM of our own."""
        target = self.spec.parent_pid or os.getpid()
        logger.info("%s: node %d asks the group to shut down; sending SIGTERM to pid %d",
                    self.name, req.node_rank, target)
        os.kill(target, signal.SIGTERM)

    def _stop_cleanly(self, mode: str) -> int:
        aborted = sorted(self.live)
        if aborted:
            logger.info("%s: aborting %d in-flight requests", self.name, len(aborted))
            self.engine_core.abort_requests(aborted)
            step = StepOutput(outputs=[
                EngineCoreOutput(rid, [], finish_reason=FinishReason.ABORT) for rid in aborted])
            self._send_outputs(step, set())
            self.live.clear()
        self.engine_core.shutdown()  # workers and headless nodes stop after the last output
        self.output_queue.put(("stopped", wire.EngineStopped(os.getpid(), mode, len(aborted))))
        self.output_queue.put(None)
        self.output_thread.join(timeout=10)
        logger.info("%s: stopped (%s), %d aborted", self.name, mode, len(aborted))
        return 0

    def _die(self, exc: BaseException) -> int:
        if isinstance(exc, SystemExit) and not exc.code:
            self.output_queue.put(("stopped", wire.EngineStopped(os.getpid(), "startup", 0)))
            self.output_queue.put(None)
            self.output_thread.join(timeout=5)
            return 0
        failure = getattr(exc, "failure", None)  # WorkerFailedError: a rank failed first
        if failure is not None:
            dead = wire.EngineDead(
                process=failure.process, pid=failure.pid, rank=failure.rank,
                exc_type=failure.exc_type, message=failure.message,
                traceback=failure.traceback, hostname=failure.hostname,
                node_rank=failure.node_rank, cause=self._rank_failure_cause(failure))
            logger.error("%s: a rank failed, engine is dying: %s", self.name, dead.describe())
        else:
            tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            dead = wire.EngineDead(
                process=self.name, pid=os.getpid(), rank=self.spec.rank,
                exc_type=type(exc).__name__, message=str(exc) or repr(exc), traceback=tb,
                hostname=_socket.gethostname(),
                cause=death_cause(exc, serving=self.serving).value)
            logger.error("%s: fatal error, engine is dying: %s\n%s", self.name, dead.describe(),
                         tb)
        self.output_queue.put(("dead", dead))
        self.output_queue.put(None)
        self.output_thread.join(timeout=5)
        write_dead_termination(dead)
        self._stop_executor_after_death()
        return 1

    def _rank_failure_cause(self, failure) -> str:
        """A worker decided its exception's cause; exits and lost nodes are named here."""
        from shoal.contract.termination import Cause

        if failure.cause:
            return failure.cause
        if failure.exc_type == "NodeLost":
            return Cause.PEER_LOST.value
        return (Cause.ENGINE_ERROR if self.serving else Cause.STARTUP_ERROR).value

    def _stop_executor_after_death(self) -> None:
        """Workers and headless nodes go down with the engine (they would wait otherwise)."""
        executor = getattr(self.engine_core, "model_executor", None)
        if executor is None:
            return
        try:
            executor.abort()
        except Exception:  # noqa: BLE001 - dying anyway; the cause is already reported
            logger.exception("%s: stopping the workers after the engine's death failed",
                             self.name)

    def _watch_parent(self) -> None:
        parent = self.spec.parent_pid
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                logger.error("%s: the frontend (pid %d) is gone; exiting", self.name, parent)
                os._exit(1)

    # ----- IO threads ---------------------------------------------------------------------------

    def _input_loop(self) -> None:
        try:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, self.spec.engine_index.to_bytes(2, "little"))
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.spec.input_address)
            hello = wire.EngineHello(PROTOCOL_VERSION, ENGINE_VERSION, os.getpid(),
                                     _socket.gethostname(), self.spec.engine_index, self.spec.rank)
            sock.send(msgspec.msgpack.encode(hello))
            add_dec = MsgpackDecoder(EngineCoreRequest)
            abort_dec = MsgpackDecoder(list[str])
            util_dec = MsgpackDecoder(UtilityCall)
            ack_dec = MsgpackDecoder(wire.HandshakeAck)
            while True:
                frames = sock.recv_multipart(copy=False)
                tag = RequestType(bytes(frames[0].buffer))
                body = frames[1:]
                if tag == RequestType.ADD:
                    self.input_queue.put((tag, add_dec.decode(body)))
                elif tag == RequestType.ABORT:
                    ids = abort_dec.decode(body)
                    core = self.engine_core
                    if core is not None:  # applied right after the forward pass now running
                        core.enqueue_aborts(ids)
                    self.aborts_queue.put(ids)
                    self.input_queue.put((tag, ids))
                elif tag == RequestType.UTILITY:
                    self.input_queue.put((tag, util_dec.decode(body)))
                elif tag == RequestType.HANDSHAKE:
                    self.ack = ack_dec.decode(body)
                    self.ack_event.set()
        except Exception as exc:  # noqa: BLE001 - a broken input thread must kill the engine
            self.io_error = exc
            self.ack_event.set()
            self.input_queue.put((RequestType.EXECUTOR_FAILED,
                                  f"input thread failed: {type(exc).__name__}: {exc}"))

    def _output_loop(self) -> None:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 5000)
        sock.connect(self.spec.output_address)
        encoder = MsgpackEncoder()
        reuse: list[bytearray] = []
        pending: deque = deque()  # (tracker, buffer) still owned by ZeroMQ, oldest at the right
        while True:
            item = self.output_queue.get()
            if item is None:
                sock.close(linger=5000)
                return
            kind, obj = item
            while pending and pending[-1][0].done:
                buf = pending.pop()[1]
                if len(reuse) < MAX_REUSE_BUFFERS:
                    reuse.append(buf)
            if kind == "batch":
                buf = reuse.pop() if reuse else bytearray()
                frames = encoder.encode_into(obj, buf)
                tracker = sock.send_multipart(frames, copy=False, track=True)
                if not tracker.done:
                    pending.appendleft((tracker, buf))
                elif len(reuse) < MAX_REUSE_BUFFERS:
                    reuse.append(buf)
            elif kind == "ready":
                sock.send_multipart([wire.ENGINE_CORE_READY, msgspec.msgpack.encode(obj)])
            elif kind == "dead":
                sock.send_multipart([wire.ENGINE_CORE_DEAD, msgspec.msgpack.encode(obj)])
            elif kind == "stopped":
                sock.send_multipart([wire.ENGINE_CORE_STOPPED, msgspec.msgpack.encode(obj)])


def termination_cause(dead: wire.EngineDead):
    """The termination-message cause for a death (shared by the engine and the frontend, which
    both write the message: the frontend's copy wins in a pod, and they must agree). The dying
    process decided it (`dead.cause`); an EngineDead the frontend made for an engine that
    could not send one (killed by a signal) is an engine error."""
    from shoal.contract.termination import Cause

    if dead.cause:
        return Cause(dead.cause)
    if dead.exc_type == "NodeLost":
        return Cause.PEER_LOST
    return Cause.ENGINE_ERROR


def write_dead_termination(dead: wire.EngineDead) -> bool:
    """Write the Kubernetes termination message for a death; never raises."""
    try:
        from shoal.contract.termination import write_termination_message

        return write_termination_message(termination_cause(dead),
                                         f"{dead.describe()}\n{dead.traceback}".strip(),
                                         rank=dead.rank, exit_code=1)
    except Exception:  # noqa: BLE001 - a failure path must not mask the original error
        return False


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Before torch loads its OpenMP runtime (cpus.py says why and when threads sleep).
    from shoal.engine.cpus import omp_wait_env

    omp_env, omp_why = omp_wait_env()
    os.environ.update(omp_env)
    spec = msgspec.json.decode(argv[0], type=EngineProcSpec)
    logging.basicConfig(level=spec.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s [engine %(process)d] %(message)s")
    logging.getLogger(__name__).info("%s", omp_why)
    return EngineCoreProc(spec).run()


if __name__ == "__main__":
    sys.exit(main())
