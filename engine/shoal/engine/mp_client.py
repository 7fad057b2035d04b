"""Frontend-side clients of an EngineCore in another process: SyncMPClient and AsyncMPClient.

Boundary: these objects live in the frontend process. They own the ROUTER (inputs, bound) and
PULL (outputs, bound) sockets and the engine's OS process; the engine connects a DEALER and a
PUSH (engine_core_proc.py). ipc:// locally, tcp:// when `host` is given (another host connects).

Start-up: bind, spawn `python -m shoal.engine.engine_core_proc SPEC`, answer its EngineHello with a
HandshakeAck (protocol version checked on both sides), then wait for EngineReady, which carries the
real max_model_len and block counts known only after KV sizing. While waiting, the engine process
is watched: if it dies, start-up fails at once with the engine's own error (EngineDead), or with
its exit status when it could not say anything (SIGKILL, OOM killer).

Wire handles: each ADD carries a small integer; outputs name requests by it (codec.OutputCodec).
A handle is reused only after its request finished in the engine (a finish output arrived), never
after an abort, because the engine may still emit for an aborted request until it sees the abort.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from array import array
from collections.abc import Iterable
from typing import Any, NamedTuple

import msgspec
import zmq
import zmq.asyncio
from shoal.engine import __version__ as ENGINE_VERSION
from shoal.engine import wire
from shoal.engine.codec import MsgpackDecoder, MsgpackEncoder, OutputCodec
from shoal.engine.core_client import EngineCoreClient
from shoal.engine.wire import (
    PROTOCOL_VERSION,
    EngineCoreOutputs,
    EngineCoreRequest,
    RequestType,
    UtilityCall,
)

logger = logging.getLogger("shoal.engine.mp_client")

READY_TIMEOUT_ENV = "SHOAL_ENGINE_READY_TIMEOUT_S"
DEFAULT_READY_TIMEOUT_S = 600.0


class ColumnarOutputs(NamedTuple):
    """One step as the frontend consumes it: plain decode tokens as two columns (request id,
    token id; the id is None for requests already aborted here) plus every other output, the
    stats and notices in `outputs` (EngineCoreOutputs)."""

    outputs: EngineCoreOutputs
    token_request_ids: list[str | None]
    token_ids: array


class EngineDeadError(RuntimeError):
    """The engine process died; `dead` names the process, rank and root cause."""

    def __init__(self, dead: wire.EngineDead) -> None:
        super().__init__(f"the engine died: {dead.describe()}")
        self.dead = dead


class EngineStoppedError(RuntimeError):
    """The engine exited cleanly on request (shutdown); nothing more will come."""


class EngineStartupError(RuntimeError):
    """Start-up failed before the engine could report a root cause of its own."""


def _exit_description(name: str, pid: int, returncode: int | None) -> str:
    if returncode is None:
        return f"{name} (pid {pid}) is still running"
    if returncode < 0:
        sig = signal.Signals(-returncode).name
        hint = " (possibly the kernel's OOM killer)" if sig == "SIGKILL" else ""
        return f"{name} (pid {pid}) was killed by {sig}{hint}"
    return f"{name} (pid {pid}) exited with code {returncode} without reporting an error"


def synthesize_dead(name: str, pid: int, returncode: int | None) -> wire.EngineDead:
    """An EngineDead for an engine that could not send its own (killed by a signal)."""
    return wire.EngineDead(process=name, pid=pid, rank=0, exc_type="ProcessExit",
                           message=_exit_description(name, pid, returncode))


class _EngineProcess:
    """The frontend's handle on one engine process: sockets bound, process spawned, handshake
    done. Everything here runs before any request, in the constructing thread."""

    def __init__(self, config, *, shutdown_timeout: float = 0.0, host: str | None = None,
                 engine_index: int = 0, log_level: str = "INFO",
                 ready_timeout: float | None = None,
                 engine_module: str = "shoal.engine.engine_core_proc",
                 env: dict[str, str] | None = None) -> None:
        import dataclasses

        self.name = f"EngineCore_{engine_index}"
        self.ctx = zmq.Context()
        self.input = self.ctx.socket(zmq.ROUTER)
        self.output = self.ctx.socket(zmq.PULL)
        for s in (self.input, self.output):
            s.setsockopt(zmq.LINGER, 0)
        self._ipc_dir = None
        if host:
            self.input.bind(f"tcp://{host}:*")
            self.output.bind(f"tcp://{host}:*")
        else:
            self._ipc_dir = tempfile.mkdtemp(prefix="shoal-")
            tag = uuid.uuid4().hex[:8]
            self.input.bind(f"ipc://{self._ipc_dir}/{tag}-in")
            self.output.bind(f"ipc://{self._ipc_dir}/{tag}-out")
        addr_in = self.input.getsockopt_string(zmq.LAST_ENDPOINT)
        addr_out = self.output.getsockopt_string(zmq.LAST_ENDPOINT)
        cfg = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
               if f.init and f.name not in ("architectures", "model_max_len")}
        spec = {
            "input_address": addr_in, "output_address": addr_out, "config": cfg,
            "engine_index": engine_index, "shutdown_timeout": float(shutdown_timeout),
            "parent_pid": os.getpid(), "log_level": log_level,
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", engine_module, msgspec.json.encode(spec).decode()],
            stdin=subprocess.DEVNULL, env=None if env is None else {**os.environ, **env},
        )
        self.pid = self.proc.pid
        logger.info("started %s (pid %d), waiting for it to load the model", self.name, self.pid)
        timeout = ready_timeout or float(os.environ.get(READY_TIMEOUT_ENV, DEFAULT_READY_TIMEOUT_S))
        try:
            self.identity, self.ready = self._handshake(timeout)
        except BaseException:
            self.kill()
            self.close()
            raise

    def _handshake(self, timeout: float) -> tuple[bytes, wire.EngineReady]:
        deadline = time.monotonic() + timeout
        poller = zmq.Poller()
        poller.register(self.input, zmq.POLLIN)
        poller.register(self.output, zmq.POLLIN)
        identity = None
        while True:
            events = dict(poller.poll(100))
            if self.input in events:
                ident, payload = self.input.recv_multipart()
                hello = msgspec.msgpack.decode(payload, type=wire.EngineHello)
                ok = hello.protocol_version == PROTOCOL_VERSION
                reason = "" if ok else (
                    f"wire protocol mismatch: frontend v{PROTOCOL_VERSION} (shoal "
                    f"{ENGINE_VERSION}), engine v{hello.protocol_version} (shoal "
                    f"{hello.engine_version}); run the same shoal version on both")
                ack = wire.HandshakeAck(PROTOCOL_VERSION, ENGINE_VERSION, ok, reason)
                self.input.send_multipart(
                    [ident, RequestType.HANDSHAKE.value, msgspec.msgpack.encode(ack)])
                if not ok:
                    raise EngineStartupError(reason)
                identity = ident
            if self.output in events:
                frames = self.output.recv_multipart()
                if frames[0] == wire.ENGINE_CORE_READY:
                    ready = msgspec.msgpack.decode(frames[1], type=wire.EngineReady)
                    if ready.protocol_version != PROTOCOL_VERSION:
                        raise EngineStartupError(
                            f"engine ready with protocol v{ready.protocol_version}, expected "
                            f"v{PROTOCOL_VERSION}")
                    assert identity is not None
                    return identity, ready
                if frames[0] == wire.ENGINE_CORE_DEAD:
                    raise EngineDeadError(msgspec.msgpack.decode(frames[1], type=wire.EngineDead))
                if frames[0] == wire.ENGINE_CORE_STOPPED:
                    raise EngineStartupError(f"{self.name} stopped during start-up (signalled)")
            if self.proc.poll() is not None and not events:
                # One last look for a death notice that raced the exit.
                if self.output.poll(200):
                    continue
                raise EngineDeadError(synthesize_dead(self.name, self.pid, self.proc.returncode))
            if time.monotonic() > deadline:
                raise EngineStartupError(
                    f"{self.name} (pid {self.pid}) was not ready within {timeout:.0f} s "
                    f"({'handshake done' if identity else 'no handshake'}); raise "
                    f"{READY_TIMEOUT_ENV} if loading is just slow")

    def terminate(self, timeout: float = 30.0, signalled: bool = False) -> int | None:
        """SIGTERM (unless the engine already stopped on its own), wait, then SIGKILL: the
        engine runs its shutdown mode on SIGTERM."""
        if self.proc.poll() is None:
            if not signalled:
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.warning("%s (pid %d) did not stop in %.0f s; killing it", self.name,
                               self.pid, timeout)
                self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        self.input.close(0)
        self.output.close(0)
        self.ctx.term()
        if self._ipc_dir:
            import shutil

            shutil.rmtree(self._ipc_dir, ignore_errors=True)


class _MPClientBase(EngineCoreClient):
    """Encoding, wire handles and the decode of one output message, shared by both clients."""

    def __init__(self, config, *, shutdown_timeout: float = 0.0, host: str | None = None,
                 log_level: str = "INFO", ready_timeout: float | None = None,
                 engine_module: str = "shoal.engine.engine_core_proc",
                 env: dict[str, str] | None = None) -> None:
        """`engine_module` / `env`: what runs as the engine process (tests substitute a fake
        engine to exercise the handshake; env adds variables such as fault injection)."""
        self.engine = _EngineProcess(config, shutdown_timeout=shutdown_timeout, host=host,
                                     log_level=log_level, ready_timeout=ready_timeout,
                                     engine_module=engine_module, env=env)
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

    def _decode(self, frames: list, columnar: bool = False) -> Any:
        """EngineCoreOutputs (ColumnarOutputs if `columnar`), or an EngineDead / EngineStopped
        notice."""
        head = frames[0].buffer if hasattr(frames[0], "buffer") else frames[0]
        if len(frames) == 2 and bytes(head[:13]) == b"ENGINE_CORE_D":
            self.dead = msgspec.msgpack.decode(frames[1].bytes, type=wire.EngineDead)
            return self.dead
        if len(frames) == 2 and bytes(head[:13]) == b"ENGINE_CORE_S":
            self.stopped = msgspec.msgpack.decode(frames[1].bytes, type=wire.EngineStopped)
            return self.stopped
        batch = self.decoder.decode(frames)
        if columnar:
            rids, toks, extras = OutputCodec.columns(batch, self._id_of)
            outs = OutputCodec.shell(batch, extras)
        else:
            outs = OutputCodec.from_batch(batch, self._id_of)
        for o in outs.outputs:
            if o.finish_reason is not None:
                self._release(o.request_id)
        for r in outs.rejected or ():
            self._release(r.request_id)
        return ColumnarOutputs(outs, rids, toks) if columnar else outs

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
        self._close_sockets()

    def _close_sockets(self) -> None:
        self.engine.close()


class SyncMPClient(_MPClientBase):
    """For the offline LLM class: blocking calls; a receiver thread owns the PULL socket."""

    def __init__(self, config, **kwargs) -> None:
        super().__init__(config, **kwargs)
        self._outputs: queue.Queue = queue.Queue()
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._send_lock = threading.Lock()
        self._stop = threading.Event()
        self._receiver = threading.Thread(target=self._receive_loop, name="mp-client-recv",
                                          daemon=True)
        self._receiver.start()
        threading.Thread(target=self._watch_process, name="mp-client-watch", daemon=True).start()

    def _receive_loop(self) -> None:
        sock = self.engine.output
        while not self._stop.is_set():
            if not sock.poll(100):
                continue
            try:
                frames = sock.recv_multipart(copy=False)
            except zmq.ZMQError:
                return
            item = self._decode(frames)
            if isinstance(item, EngineCoreOutputs) and item.utility_output is not None:
                fut = self._calls.pop(item.utility_output.call_id, None)
                if fut is not None:
                    try:
                        fut.set_result(self._utility_result(item.utility_output))
                    except Exception as exc:  # noqa: BLE001
                        fut.set_exception(exc)
                if not item.outputs and not item.rejected:
                    continue
            self._outputs.put(item)
            if not isinstance(item, EngineCoreOutputs):
                return

    def _watch_process(self) -> None:
        self.engine.proc.wait()
        self._receiver.join(timeout=2.0)
        if self._stop.is_set():
            return
        dead = self._engine_exit_notice()
        if dead is not None:
            for fut in list(self._calls.values()):
                fut.set_exception(EngineDeadError(dead))
            self._calls.clear()
            self._outputs.put(dead)

    def add_request(self, request: EngineCoreRequest) -> None:
        with self._send_lock:
            self.engine.input.send_multipart(self._add_frames(request), copy=False)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        with self._send_lock:
            frames = self._abort_frames(request_ids)
            if frames:
                self.engine.input.send_multipart(frames, copy=False)

    def get_output(self) -> EngineCoreOutputs:
        item = self._outputs.get()
        if isinstance(item, EngineCoreOutputs):
            return item
        self._outputs.put(item)  # every later caller sees the same end
        if isinstance(item, wire.EngineDead):
            raise EngineDeadError(item)
        raise EngineStoppedError(f"the engine stopped ({item.mode})")

    def call_utility(self, method: str, *args: Any, timeout: float = 60.0) -> Any:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._send_lock:
            call_id, frames = self._utility_frames(method, args)
            self._calls[call_id] = fut
            self.engine.input.send_multipart(frames, copy=False)
        return fut.result(timeout)

    def shutdown(self, timeout: float = 30.0) -> None:
        if self._closed:
            return
        self._stop.set()
        self._receiver.join(timeout=2.0)
        super().shutdown(timeout)


class AsyncMPClient(_MPClientBase):
    """For AsyncLLM: asyncio sockets; one reader task owns PULL and fills an asyncio.Queue.

    Construct it (blocking: the start-up handshake) before the event loop serves traffic, then
    call `start()` inside the loop."""

    def __init__(self, config, **kwargs) -> None:
        super().__init__(config, **kwargs)
        self._outputs: asyncio.Queue | None = None
        self._calls: dict[int, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None
        self._final_notice = None  # asyncio.Event, set once DEAD/STOPPED arrived

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._outputs = asyncio.Queue()
        self._final_notice = asyncio.Event()
        self._ain = zmq.asyncio.Socket.from_socket(self.engine.input)
        self._aout = zmq.asyncio.Socket.from_socket(self.engine.output)
        self._reader = loop.create_task(self._read_loop())
        threading.Thread(target=self._watch_process, args=(loop,), name="mp-client-watch",
                         daemon=True).start()

    async def _read_loop(self) -> None:
        while True:
            try:
                frames = await self._aout.recv_multipart(copy=False)
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            item = self._decode(frames, columnar=True)
            if isinstance(item, ColumnarOutputs):
                outs = item.outputs
                if outs.utility_output is not None:
                    fut = self._calls.pop(outs.utility_output.call_id, None)
                    if fut is not None and not fut.done():
                        try:
                            fut.set_result(self._utility_result(outs.utility_output))
                        except Exception as exc:  # noqa: BLE001
                            fut.set_exception(exc)
                    if not outs.outputs and not outs.rejected and not item.token_ids:
                        continue
                self._outputs.put_nowait(item)
                continue
            self._final_notice.set()
            self._finish(item)
            return

    def _finish(self, item: Any) -> None:
        err = (EngineDeadError(item) if isinstance(item, wire.EngineDead)
               else EngineStoppedError("the engine stopped"))
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(err)
        self._calls.clear()
        self._outputs.put_nowait(item)

    def _watch_process(self, loop: asyncio.AbstractEventLoop) -> None:
        self.engine.proc.wait()
        if not self._closed:
            asyncio.run_coroutine_threadsafe(self._on_exit(), loop)

    async def _on_exit(self) -> None:
        # An engine that exited by itself sent its notice (death or stop) before exiting: give
        # the socket time to deliver it. One killed by a signal sent none: only what is already
        # in flight can still arrive.
        killed = (self.engine.proc.returncode or 0) < 0
        try:
            await asyncio.wait_for(self._final_notice.wait(), 0.2 if killed else 2.0)
            return  # the reader already delivered the engine's own notice
        except asyncio.TimeoutError:
            pass
        if self._reader is not None:
            self._reader.cancel()
        dead = self._engine_exit_notice()
        self._finish(dead if dead is not None else self.stopped)

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        await self._ain.send_multipart(self._add_frames(request), copy=False)

    async def abort_requests_async(self, request_ids: Iterable[str]) -> None:
        frames = self._abort_frames(request_ids)
        if frames:
            await self._ain.send_multipart(frames, copy=False)

    async def get_output_async(self) -> EngineCoreOutputs:
        """One step's outputs as per-request objects (the EngineCoreClient contract)."""
        cols = await self.get_columnar_output_async()
        outs = cols.outputs
        outs.outputs = [wire.EngineCoreOutput(r, [t]) for r, t in
                        zip(cols.token_request_ids, cols.token_ids, strict=True)
                        if r is not None] + outs.outputs
        return outs

    async def get_columnar_output_async(self) -> ColumnarOutputs:
        """One step's outputs in the columnar form AsyncLLM consumes (no per-token objects)."""
        item = await self._outputs.get()
        if isinstance(item, ColumnarOutputs):
            return item
        self._outputs.put_nowait(item)
        if isinstance(item, wire.EngineDead):
            raise EngineDeadError(item)
        raise EngineStoppedError(f"the engine stopped ({getattr(item, 'mode', 'unknown')})")

    async def call_utility_async(self, method: str, *args: Any, timeout: float = 60.0) -> Any:
        call_id, frames = self._utility_frames(method, args)
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        await self._ain.send_multipart(frames, copy=False)
        return await asyncio.wait_for(fut, timeout)

    # The EngineCoreClient sync interface, for completeness: AsyncLLM uses the async methods.
    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine.input.send_multipart(self._add_frames(request), copy=False)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        frames = self._abort_frames(request_ids)
        if frames:
            self.engine.input.send_multipart(frames, copy=False)

    def get_output(self) -> EngineCoreOutputs:
        raise RuntimeError("AsyncMPClient: use `await get_output_async()`")

    def call_utility(self, method: str, *args: Any) -> Any:
        raise RuntimeError("AsyncMPClient: use `await call_utility_async(...)`")

    def shutdown(self, timeout: float = 30.0) -> None:
        if self._closed:
            return
        if self._reader is not None:
            self._reader.cancel()
        super().shutdown(timeout)
