"""AsyncMPClient: the engine process's client on the API server's asyncio loop (AsyncLLM).

asyncio sockets over the EngineProcess's own; one reader task owns PULL and fills an
asyncio.Queue with StepOutputs (a UTILITY answer resolves its future instead). A watcher thread
waits on the engine's OS process: an engine that exited by itself sent its last notice first,
one killed by a signal sent none, and then the client names the exit itself.

Construct it (blocking: the start-up handshake) before the event loop serves traffic, then call
`start()` inside the loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable
from typing import Any

import zmq
import zmq.asyncio
from shoal.engine import wire
from shoal.engine.core.sched_output import StepOutput
from shoal.engine.core_client.mp_client import MPClient
from shoal.engine.errors import EngineDeadError, EngineStoppedError
from shoal.engine.wire import EngineCoreRequest


class AsyncMPClient(MPClient):
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
            item = self._decode(frames)
            if not isinstance(item, StepOutput):
                self._final_notice.set()
                self._finish(item)
                return
            if item.utility_output is not None:
                self._resolve_call(item.utility_output)
                if not item.outputs and not item.rejected and not item.decode_token_ids:
                    continue
            self._outputs.put_nowait(item)

    def _resolve_call(self, out: wire.UtilityOutput) -> None:
        fut = self._calls.pop(out.call_id, None)
        if fut is None or fut.done():
            return
        try:
            fut.set_result(self._utility_result(out))
        except Exception as exc:  # noqa: BLE001
            fut.set_exception(exc)

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

    async def get_output_async(self) -> StepOutput:
        """One step's outputs; EngineDeadError / EngineStoppedError once the engine is gone
        (every later caller sees the same end)."""
        item = await self._outputs.get()
        if isinstance(item, StepOutput):
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

    def shutdown(self, timeout: float = 30.0) -> None:
        if self._closed:
            return
        if self._reader is not None:
            self._reader.cancel()
        super().shutdown(timeout)
