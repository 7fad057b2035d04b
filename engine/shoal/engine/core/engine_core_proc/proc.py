"""EngineCoreProc: the engine process's lifecycle, around the pure EngineCore.

Lifecycle: start the IO threads (io_threads.py) -> HELLO/ACK (protocol check) -> build the
EngineCore (weights, KV sizing) -> READY -> the busy loop (busy_loop.py) -> a clean stop or a
death. SIGTERM: `shutdown_timeout` 0 aborts everything in flight and sends the abort outputs
before exiting 0; > 0 drains first. A fatal error sends ENGINE_CORE_DEAD with the root cause
(death.py), writes the Kubernetes termination message and exits 1. A watchdog thread exits the
process if the frontend that started it is gone.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from typing import Any

import msgspec
import zmq
from shoal.engine import __version__ as ENGINE_VERSION
from shoal.engine import wire
from shoal.engine.core.engine_core_proc import io_threads
from shoal.engine.core.engine_core_proc.busy_loop import BusyLoop
from shoal.engine.core.engine_core_proc.death import engine_dead, write_dead_termination
from shoal.engine.wire import PROTOCOL_VERSION, RequestType

logger = logging.getLogger("shoal.engine.core_proc")

HANDSHAKE_TIMEOUT_S = 60.0


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
    scheduling_policy: str = "fcfs"  # vLLM's --scheduling-policy (core/request_queue.py)


class EngineCoreProc:
    """See the module docstring. Construct, then `run()`; `run()` returns the exit code."""

    def __init__(self, spec: EngineProcSpec) -> None:
        self.spec = spec
        self.name = f"EngineCore_{spec.engine_index}"
        self.started = time.monotonic()
        self.ch = io_threads.Channels()
        self.engine_core = None
        self.loop: BusyLoop | None = None
        self.shutdown_requested = False
        self.serving = False  # start-up finished: deaths from here on are not start-up faults
        self.ctx = zmq.Context()

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_sigterm)
        signal.signal(signal.SIGINT, self._on_sigterm)
        self.output_thread = io_threads.start(self.ctx, self.spec, self.ch)
        if self.spec.parent_pid:
            threading.Thread(target=self._watch_parent, name="watchdog", daemon=True).start()
        try:
            self._wait_for_ack()
            self._build_engine()
            self._send_ready()
            self.serving = True
            return self._stop_cleanly(self.loop.run())
        except BaseException as exc:  # noqa: BLE001 - every failure must be reported
            return self._die(exc)

    def _wait_for_ack(self) -> None:
        ch = self.ch
        if not ch.ack_event.wait(HANDSHAKE_TIMEOUT_S):
            raise TimeoutError(f"no handshake from the frontend at {self.spec.input_address} "
                               f"within {HANDSHAKE_TIMEOUT_S:.0f} s")
        if ch.io_error is not None:
            raise ch.io_error
        ack = ch.ack
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
        core = self.engine_core = EngineCore(config,
                                             scheduling_policy=self.spec.scheduling_policy)
        self.loop = BusyLoop(core, self.ch, self.name, self.spec.shutdown_timeout)
        self.ch.engine_core = core
        executor = core.model_executor
        executor.failure_callbacks.append(  # a rank failed: wake the busy loop
            lambda failure: self.ch.input.put((RequestType.EXECUTOR_FAILED, failure)))
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
        self.ch.send(wire.ENGINE_CORE_READY, ready)

    # ----- shutdown and death -------------------------------------------------------------------

    def _on_sigterm(self, signum, frame) -> None:
        if self.shutdown_requested:
            return
        self.shutdown_requested = True
        logger.info("%s: received %s, shutting down (mode %s)", self.name,
                    signal.Signals(signum).name,
                    "abort" if self.spec.shutdown_timeout <= 0 else "drain")
        if self.loop is None:  # still starting: nothing in flight
            raise SystemExit(0)
        self.loop.shutdown_requested = True

    def _group_shutdown_requested(self, req) -> None:
        """A headless node got SIGTERM: the whole group shuts down, led from here (drain or
        abort by --shutdown-timeout), through the frontend as for a SIGTERM of our own."""
        target = self.spec.parent_pid or os.getpid()
        logger.info("%s: node %d asks the group to shut down; sending SIGTERM to pid %d",
                    self.name, req.node_rank, target)
        os.kill(target, signal.SIGTERM)

    def _stop_cleanly(self, mode: str) -> int:
        aborted = self.loop.abort_in_flight()
        self.engine_core.shutdown()  # workers and headless nodes stop after the last output
        self._last_notice(wire.ENGINE_CORE_STOPPED, wire.EngineStopped(os.getpid(), mode, aborted),
                          10)
        logger.info("%s: stopped (%s), %d aborted", self.name, mode, aborted)
        return 0

    def _die(self, exc: BaseException) -> int:
        if isinstance(exc, SystemExit) and not exc.code:
            self._last_notice(wire.ENGINE_CORE_STOPPED, wire.EngineStopped(os.getpid(),
                                                                           "startup", 0), 5)
            return 0
        dead = engine_dead(exc, process=self.name, rank=self.spec.rank, serving=self.serving)
        if getattr(exc, "failure", None) is not None:
            logger.error("%s: a rank failed, engine is dying: %s", self.name, dead.describe())
        else:
            logger.error("%s: fatal error, engine is dying: %s\n%s", self.name, dead.describe(),
                         dead.traceback)
        self._last_notice(wire.ENGINE_CORE_DEAD, dead, 5)
        write_dead_termination(dead)
        self._stop_executor_after_death()
        return 1

    def _last_notice(self, kind: bytes, notice: Any, timeout: float) -> None:
        self.ch.send(kind, notice)
        self.ch.close_output()
        self.output_thread.join(timeout=timeout)

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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Before torch loads its OpenMP runtime (worker/cpu/cpus.py says why and when threads sleep).
    from shoal.engine.worker.cpu.cpus import omp_wait_env

    omp_env, omp_why = omp_wait_env()
    os.environ.update(omp_env)
    spec = msgspec.json.decode(argv[0], type=EngineProcSpec)
    logging.basicConfig(level=spec.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s [engine %(process)d] %(message)s")
    logger.info("%s", omp_why)
    return EngineCoreProc(spec).run()
