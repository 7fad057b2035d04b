"""MPClient: what every client of an engine process shares, whatever its concurrency.

It owns the EngineProcess (spawn.py) and does the work on either side of the sockets that does
not wait: the frames of each ADD / ABORT / UTILITY, and the decode of each output message into a
StepOutput or the engine's last notice (EngineDead, EngineStopped), told apart from a batch by
the wire's notice constants. AsyncMPClient (async_client.py) adds the sockets' IO.

Wire handles: each ADD carries a small integer; outputs name requests by it (codec.OutputCodec).
A handle is reused only after its request finished in the engine (a finish output arrived), never
after an abort, because the engine may still emit for an aborted request until it sees the abort.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec
from shoal.engine import wire
from shoal.engine.codec import MsgpackDecoder, MsgpackEncoder, OutputCodec
from shoal.engine.core.sched_output import StepOutput
from shoal.engine.core_client.spawn import ENGINE_MODULE, EngineProcess, synthesize_dead
from shoal.engine.errors import EngineDeadError
from shoal.engine.wire import EngineCoreRequest, RequestType, UtilityCall

# The engine's last words on the output socket: [constant][struct], two frames.
NOTICES = {wire.ENGINE_CORE_DEAD: wire.EngineDead, wire.ENGINE_CORE_STOPPED: wire.EngineStopped}
_NOTICE_MAX = max(map(len, NOTICES))


def notice_type(frames: list) -> type | None:
    """The struct of a two-frame notice, or None for an output batch (checked by length
    first, so a batch's frame is never copied to compare it)."""
    if len(frames) != 2:
        return None
    head = getattr(frames[0], "buffer", frames[0])
    if len(head) > _NOTICE_MAX:
        return None
    return NOTICES.get(bytes(head))


class MPClient:
    def __init__(self, config, *, shutdown_timeout: float = 0.0, host: str | None = None,
                 log_level: str = "INFO", ready_timeout: float | None = None,
                 engine_module: str = ENGINE_MODULE,
                 env: dict[str, str] | None = None, scheduling_policy: str = "fcfs") -> None:
        """`engine_module` / `env`: what runs as the engine process (tests substitute a fake
        engine to exercise the handshake; env adds variables such as fault injection)."""
        self.engine = EngineProcess(config, shutdown_timeout=shutdown_timeout, host=host,
                                    log_level=log_level, ready_timeout=ready_timeout,
                                    engine_module=engine_module, env=env,
                                    scheduling_policy=scheduling_policy)
        self.ready = self.engine.ready
        self.max_model_len = self.ready.max_model_len
        self.num_blocks = self.ready.num_blocks
        self.block_size = self.ready.block_size
        self.encoder = MsgpackEncoder()
        self.decoder = MsgpackDecoder(wire.OutputBatch)
        self._id_of: dict[int, str] = {}  # handle -> request id of live requests
        self._handle_of: dict[str, int] = {}
        self._free_handles: list[int] = []
        self._next_handle = 0
        self._call_ids = iter(range(1, 1 << 62))
        self.dead: wire.EngineDead | None = None
        self.stopped: wire.EngineStopped | None = None
        self._closed = False

    # ----- encode side -------------------------------------------------------------------------

    def _assign_handle(self, request: EngineCoreRequest) -> None:
        if self._free_handles:
            h = self._free_handles.pop()
        else:
            h, self._next_handle = self._next_handle, self._next_handle + 1
        request.wire_handle = h
        self._id_of[h] = request.request_id
        self._handle_of[request.request_id] = h

    def _add_frames(self, request: EngineCoreRequest) -> list:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        self._assign_handle(request)
        return [self.engine.identity, RequestType.ADD.value, *self.encoder.encode(request)]

    def _abort_frames(self, request_ids: Iterable[str]) -> list | None:
        ids = list(request_ids)
        for rid in ids:
            h = self._handle_of.pop(rid, None)
            if h is not None:
                del self._id_of[h]  # quarantined: never reused (see the module docstring)
        if not ids or self.dead is not None or self.stopped is not None:
            return None
        return [self.engine.identity, RequestType.ABORT.value, *self.encoder.encode(ids)]

    def _utility_frames(self, method: str, args: tuple) -> tuple[int, list]:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        call_id = next(self._call_ids)
        call = UtilityCall(call_id, method, list(args))
        return call_id, [self.engine.identity, RequestType.UTILITY.value,
                         *self.encoder.encode(call)]

    # ----- decode side -------------------------------------------------------------------------

    def _decode(self, frames: list) -> StepOutput | wire.EngineDead | wire.EngineStopped:
        """A step's outputs, or the engine's last notice (kept in `dead` / `stopped`)."""
        kind = notice_type(frames)
        if kind is not None:
            notice = msgspec.msgpack.decode(frames[1].bytes, type=kind)
            if kind is wire.EngineDead:
                self.dead = notice
            else:
                self.stopped = notice
            return notice
        step = OutputCodec.unpack(self.decoder.decode(frames), self._id_of)
        for rid in step.finished_requests:
            self._release(rid)
        for r in step.rejected or ():
            self._release(r.request_id)
        return step

    def _release(self, request_id: str) -> None:
        h = self._handle_of.pop(request_id, None)
        if h is not None:
            del self._id_of[h]
            self._free_handles.append(h)

    @staticmethod
    def _utility_result(out: wire.UtilityOutput) -> Any:
        if out.failure_message is not None:
            raise RuntimeError(f"engine utility call failed: {out.failure_message}")
        return msgspec.msgpack.decode(out.result) if out.result is not None else None

    def _engine_exit_notice(self) -> wire.EngineDead | None:
        """After the process exited: the death to report, or None for a requested stop."""
        if self.dead is not None:
            return self.dead
        if self.stopped is not None:
            return None
        self.dead = synthesize_dead(self.engine.name, self.engine.pid, self.engine.proc.returncode)
        return self.dead

    def shutdown(self, timeout: float = 30.0) -> None:
        if self._closed:
            return
        self._closed = True
        self.engine.terminate(timeout, signalled=self.stopped is not None or self.dead is not None)
        self.engine.close()
