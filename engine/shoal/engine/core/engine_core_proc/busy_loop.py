"""The busy loop: the engine process's main thread, the EngineCore's only caller.

It never touches a socket: it reads `Channels.input` / `Channels.aborts` (io_threads.py) and
writes `Channels.output`. Each turn: handle what arrived (ADD, ABORT, UTILITY, a failed rank or
IO thread), step if there is work, apply the aborts that arrived during the forward pass, and
hand the step's outputs to the output thread as one OutputBatch. Requests are named on the wire
by the small handle their ADD carried; a handle dies with its request, after the batch that
finishes it.

Shutdown (`shutdown_requested`, set by SIGTERM): with `shutdown_timeout` 0 the loop returns at
once ("abort"); above 0 it drains: new ADDs are rejected with 503, stepping goes on until idle
or the deadline ("drain"). `abort_in_flight` then ends what is left.
"""

from __future__ import annotations

import logging
import os
import queue
import time
from typing import Any

import msgspec
from shoal.engine import wire
from shoal.engine.codec import OutputCodec
from shoal.engine.core.engine_core_proc.io_threads import BATCH, Channels
from shoal.engine.core.sched_output import StepOutput
from shoal.engine.wire import (
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


class Fatal(Exception):
    """Raised inside the busy loop to turn a background failure into a clean death message."""


class BusyLoop:
    def __init__(self, engine_core, ch: Channels, name: str, shutdown_timeout: float) -> None:
        self.core = engine_core
        self.ch = ch
        self.name = name
        self.shutdown_timeout = shutdown_timeout
        self.handles: dict[str, int] = {}  # request id -> wire handle of every live request
        self.live: set[str] = set()
        self.pending_rejections: list[RequestRejected] = []
        self.shutdown_requested = False
        self.draining = False

    def run(self) -> str:
        """Returns the shutdown mode once a requested shutdown has finished its work."""
        core = self.core
        deadline = None
        busy = False
        while True:
            if self.shutdown_requested and deadline is None:
                if self.shutdown_timeout <= 0:
                    return "abort"
                self.draining = True
                deadline = time.monotonic() + self.shutdown_timeout
                logger.info("%s: draining %d requests (timeout %.0f s); new requests rejected",
                            self.name, len(self.live), self.shutdown_timeout)
            if deadline is not None and (not core.has_unfinished_requests()
                                         or time.monotonic() >= deadline):
                self._drain_input()
                return "drain"
            self._drain_input(block=not core.has_unfinished_requests() and not busy)
            if core.has_unfinished_requests():
                step = core.step()
                aborted = self._apply_aborts()
                self._send_outputs(step, aborted)
                busy = True
            elif busy or self.pending_rejections:
                # Going idle: publish fresh gauges (running 0, KV usage after frees), or they
                # would show the last busy step until the next request.
                self._send_outputs(StepOutput(scheduler_stats=core.make_stats()), set())
                busy = False

    def abort_in_flight(self) -> int:
        """End every live request with an ABORT output (shutdown); returns how many."""
        aborted = sorted(self.live)
        if aborted:
            logger.info("%s: aborting %d in-flight requests", self.name, len(aborted))
            self.core.abort_requests(aborted)
            step = StepOutput(outputs=[
                EngineCoreOutput(rid, [], finish_reason=FinishReason.ABORT) for rid in aborted])
            self._send_outputs(step, set())
            self.live.clear()
        return len(aborted)

    def _drain_input(self, block: bool = False) -> None:
        """Handle everything queued; if `block`, wait (briefly, to notice signals) for one."""
        try:
            item = self.ch.input.get(timeout=0.2) if block else self.ch.input.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self.ch.input.get_nowait()
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
                raise Fatal(payload)
            from shoal.engine.executor.multiproc_executor import WorkerFailedError

            raise WorkerFailedError(payload)

    def _add(self, req: EngineCoreRequest) -> None:
        if self.draining:
            self._reject(req, 503, "the engine is shutting down (draining) and admits no new "
                                   "requests; retry on another replica")
            return
        try:
            self.core.add_request(req)
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
            self.core.abort_requests(ids)
        for rid in ids:
            self.live.discard(rid)
            self.handles.pop(rid, None)

    def _apply_aborts(self) -> set[str]:
        """Aborts that arrived during the forward pass: applied before outputs are sent, so an
        aborted request's blocks are free for the next schedule and its tokens are not sent."""
        aborted: set[str] = set()
        while True:
            try:
                ids = self.ch.aborts.get_nowait()
            except queue.Empty:
                break
            aborted.update(r for r in ids if r in self.live)
            self._abort(ids)
        return aborted

    def _send_outputs(self, step: StepOutput, aborted: set[str]) -> None:
        if aborted:
            step.drop(aborted)
        step.rejected, self.pending_rejections = self.pending_rejections or None, []
        step.timestamp = time.monotonic()
        batch = OutputCodec.pack(step, self.handles.get)
        for rid in step.finished_requests:  # handles die with their request, after the batch
            self.live.discard(rid)
            self.handles.pop(rid, None)
        self.ch.send(BATCH, batch)

    def _utility(self, call: UtilityCall) -> None:
        out = UtilityOutput(call.call_id)
        try:
            allowed = self.core.UTILITY_METHODS | PROC_UTILITIES
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
                result = self.core.call_utility(call.method, call.args)
            out.result = msgspec.msgpack.encode(result)
        except RuntimeError as exc:
            if call.method == "fail_for_test":
                raise
            out.failure_message = f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # noqa: BLE001 - the caller gets the reason
            out.failure_message = f"{type(exc).__name__}: {exc}"
        self.ch.send(BATCH, wire.OutputBatch(utility_output=out))
