"""EngineProcess: the frontend's handle on one engine process, up to its exit.

Boundary: the frontend owns the ROUTER (inputs, bound) and PULL (outputs, bound) sockets and the
engine's OS process; the engine connects a DEALER and a PUSH (core/engine_core_proc/). ipc://
locally, tcp:// when `host` is given (another host connects).

Start-up: bind, spawn `python -m shoal.engine.core.engine_core_proc SPEC`, answer its EngineHello
with a HandshakeAck (protocol version checked on both sides), then wait for EngineReady, which
carries the real max_model_len and block counts known only after KV sizing. While waiting, the
engine process is watched: if it dies, start-up fails at once with the engine's own error
(EngineDead), or with its exit status when it could not say anything (SIGKILL, OOM killer).
Everything here runs before any request, in the constructing thread.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import msgspec
import zmq
from shoal.engine import __version__ as ENGINE_VERSION
from shoal.engine import wire
from shoal.engine.errors import EngineDeadError, EngineStartupError
from shoal.engine.wire import PROTOCOL_VERSION, RequestType

logger = logging.getLogger("shoal.engine.core_client")

ENGINE_MODULE = "shoal.engine.core.engine_core_proc"
READY_TIMEOUT_ENV = "SHOAL_ENGINE_READY_TIMEOUT_S"
DEFAULT_READY_TIMEOUT_S = 600.0


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


class EngineProcess:
    """The frontend's handle on one engine process: sockets bound, process spawned, handshake
    done. Everything here runs before any request, in the constructing thread."""

    def __init__(self, config, *, shutdown_timeout: float = 0.0, host: str | None = None,
                 engine_index: int = 0, log_level: str = "INFO",
                 ready_timeout: float | None = None,
                 engine_module: str = ENGINE_MODULE,
                 env: dict[str, str] | None = None,
                 scheduling_policy: str = "fcfs") -> None:
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
            "scheduling_policy": scheduling_policy,
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
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
