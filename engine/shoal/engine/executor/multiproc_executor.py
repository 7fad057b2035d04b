"""MultiprocExecutor: a tensor-parallel group of worker processes, driven from the EngineCore.

Who holds what (this object lives in the EngineCore process, on node 0):
- the local workers (global ranks 0..T/K-1): child processes started here (procs.spawn_worker);
- the step broadcast (broadcast.py): a shared-memory ring to the local workers, an XPUB over TCP
  to the workers of headless nodes; only the busy-loop thread publishes;
- the reply PULL socket (ipc:// for local workers, tcp:// for remote ones), read only by the
  thread that waits for a call's replies (the busy loop): an RpcFuture polls it;
- a monitor thread that waits on the local workers' exits (pidfds), and for K > 1 the group link
  (group_link.py) that watches the headless nodes.

Failure: the first failure (a worker's exception, a worker's exit, a lost node, a headless
node's own report) is recorded once as a RankFailure; every waiting and later call raises
WorkerFailedError with it, the failure callbacks run (the EngineCoreProc wakes its busy loop),
and the local workers are killed: ranks blocked in a collective with a dead peer would hang.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import tempfile
import threading
import time
from typing import Any

import msgspec
import zmq
from shoal.engine.core.sched_output import ModelRunnerOutput
from shoal.engine.executor import procs
from shoal.engine.executor.abstract import Executor
from shoal.engine.executor.broadcast import StepBroadcaster
from shoal.engine.executor.group_link import GroupLinkServer
from shoal.engine.executor.rank_wire import (
    NODE_JOIN_TIMEOUT_S,
    STARTUP_CALL_ID,
    NodeWelcome,
    RankFailure,
    WorkerCall,
    WorkerReply,
)
from shoal.engine.executor.worker_proc import local_worker_specs

log = logging.getLogger("shoal.engine.executor")

# Result types of the calls whose results the EngineCore uses (others decode untyped).
RESULT_TYPES: dict[str, type] = {
    "determine_num_kv_blocks": int,
    "execute_model": ModelRunnerOutput,
    "get_vocab_size": int,
}
# A worker that exits with a code (not a signal) has usually replied its failure first; give
# that reply this long to arrive before naming the exit itself as the cause.
SELF_EXIT_GRACE_S = 1.0
# A rank whose collective failed is usually not the first to fail: a peer died (its exit, or its
# node's silence, is noticed within LINK_TIMEOUT_S). Wait this long for that before naming the
# collective's failure itself.
COLLECTIVE_GRACE_S = 5.0
POLL_MS = 50


class WorkerFailedError(RuntimeError):
    """A rank of the group failed; `failure` names it and the root cause."""

    def __init__(self, failure: RankFailure) -> None:
        super().__init__(failure.describe())
        self.failure = failure


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RpcFuture:
    """The replies to one broadcast call. `result()` reads the reply socket in the calling
    thread until every expected rank has answered, a rank fails, or the timeout passes."""

    def __init__(self, executor: MultiprocExecutor, call_id: int, method: str,
                 ranks: list[int]) -> None:
        self.executor, self.call_id, self.method = executor, call_id, method
        self.waiting = set(ranks)
        self.results: dict[int, Any] = {}

    def done(self) -> bool:
        return not self.waiting

    def result(self, timeout: float | None = None) -> list[Any]:
        ex = self.executor
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.waiting:
            ex.raise_if_failed()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{self.method}: ranks {sorted(self.waiting)} did not answer "
                                   f"within {timeout} s")
            ex.read_replies(POLL_MS)
        return [self.results[r] for r in sorted(self.results)]


class MultiprocExecutor(Executor):
    def _init_executor(self) -> None:
        cfg = self.config
        self.failure: RankFailure | None = None
        self.suspect: tuple[RankFailure, float] | None = None  # a collective's failure, and when
        self.lock = threading.Lock()
        self.call_ids = itertools.count(STARTUP_CALL_ID + 1)
        self.futures: dict[int, RpcFuture] = {}
        self.stopping = False  # exits from here on are expected, not failures
        self.closed = False
        self.reply_decoder = msgspec.msgpack.Decoder(WorkerReply)
        local = list(cfg.local_ranks(0))
        self.ranks = list(range(cfg.world_size))
        num_remote = cfg.world_size - len(local)
        self.broadcaster = StepBroadcaster(len(local), num_remote, cfg.master_addr)
        self.ctx = zmq.Context.instance()
        self.replies = self.ctx.socket(zmq.PULL)
        self.replies.setsockopt(zmq.LINGER, 0)
        self.ipc_dir = tempfile.mkdtemp(prefix="shoal-ranks-")
        self.reply_ipc = f"ipc://{self.ipc_dir}/replies"
        self.replies.bind(self.reply_ipc)
        self.reply_tcp = None
        if num_remote:
            port = self.replies.bind_to_random_port("tcp://*")
            self.reply_tcp = f"tcp://{cfg.master_addr}:{port}"
        port = cfg.master_port if cfg.nnodes > 1 else free_port()
        self.dist_init = f"tcp://{cfg.master_addr}:{port}"
        startup = self._expect(STARTUP_CALL_ID, "start-up", self.ranks)
        specs = local_worker_specs(cfg, self.broadcaster.local_handle(), self.reply_ipc,
                                   self.dist_init)
        self.procs = {spec.rank: procs.spawn_worker(spec) for spec in specs}
        log.info("started %d local workers (ranks %s, %d threads each, torch.distributed at %s)",
                 len(local), local, specs[0].num_threads, self.dist_init)
        self.monitor = threading.Thread(target=self._monitor, name="worker-monitor", daemon=True)
        self.monitor.start()
        self.link = None
        try:
            if cfg.nnodes > 1:
                self.link = GroupLinkServer(cfg, self._fail,
                                            lambda req: self.on_shutdown_request(req))
                welcome = NodeWelcome(self.broadcaster.tcp_address, self.reply_tcp)
                self.link.wait_for_nodes(welcome, NODE_JOIN_TIMEOUT_S, self._alive_during_start)
                self.link.start()
            startup.result(NODE_JOIN_TIMEOUT_S)
            self.broadcaster.wait_for_subscribers(NODE_JOIN_TIMEOUT_S, self.raise_if_failed)
        except BaseException:
            self.shutdown(force=True)  # ranks still loading would not answer a polite call
            raise
        log.info("all %d ranks ready", cfg.world_size)

    # -- calls ------------------------------------------------------------------------------

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                       timeout: float | None = None, unique_reply_rank: int | None = None,
                       non_block: bool = False):
        """Broadcast `method(*args)` to every rank. Returns the results in rank order (only
        `unique_reply_rank`'s, as a one-element list, if given), or the RpcFuture if
        `non_block`. Raises WorkerFailedError naming the rank if any rank fails."""
        if kwargs:
            raise TypeError("worker calls take positional arguments only (typed on the wire)")
        self.raise_if_failed()
        call_id = next(self.call_ids)
        ranks = self.ranks if unique_reply_rank is None else [unique_reply_rank]
        fut = self._expect(call_id, method, ranks)
        call = WorkerCall(call_id, method, msgspec.Raw(msgspec.msgpack.encode(list(args))),
                          -1 if unique_reply_rank is None else unique_reply_rank)
        self.broadcaster.publish(msgspec.msgpack.encode(call))
        return fut if non_block else fut.result(timeout)

    def execute_model(self, scheduler_output) -> ModelRunnerOutput:
        return self.collective_rpc("execute_model", (scheduler_output,), unique_reply_rank=0)[0]

    def get_vocab_size(self) -> int:
        return self.collective_rpc("get_vocab_size", unique_reply_rank=0)[0]

    def _expect(self, call_id: int, method: str, ranks: list[int]) -> RpcFuture:
        fut = RpcFuture(self, call_id, method, ranks)
        self.futures[call_id] = fut
        return fut

    def read_replies(self, timeout_ms: int) -> None:
        """Read what has arrived (waiting up to `timeout_ms` for the first); caller's thread."""
        if not self.replies.poll(timeout_ms):
            return
        while True:
            try:
                raw = self.replies.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            reply = self.reply_decoder.decode(raw)
            if reply.failure is not None:
                self._fail(reply.failure)
                continue
            fut = self.futures.get(reply.call_id)
            if fut is None or reply.rank not in fut.waiting:
                continue
            fut.waiting.discard(reply.rank)
            fut.results[reply.rank] = msgspec.msgpack.decode(
                reply.result, type=RESULT_TYPES.get(fut.method, Any))
            if fut.done():
                self.futures.pop(reply.call_id, None)

    # -- failure ----------------------------------------------------------------------------

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise WorkerFailedError(self.failure)

    def _alive_during_start(self) -> None:
        self.read_replies(0)  # a local rank's start-up failure, first-hand
        self.raise_if_failed()

    def _fail(self, failure: RankFailure) -> None:
        with self.lock:
            if self.failure is not None or self.stopping:
                return
            if failure.in_collective:  # probably a consequence: see COLLECTIVE_GRACE_S
                if self.suspect is None:
                    self.suspect = (failure, time.monotonic())
                    log.warning("rank %d: a collective failed (%s: %s); waiting up to %.0f s "
                                "for the peer that caused it", failure.rank, failure.exc_type,
                                failure.message.splitlines()[0][:200], COLLECTIVE_GRACE_S)
                return
            self.failure = failure
        log.error("rank %d failed first: %s%s", failure.rank, failure.describe(),
                  f"\n{failure.traceback}" if failure.traceback else "")
        for p in self.procs.values():  # peers of a dead rank would block in collectives
            if p.poll() is None:
                p.kill()
        for cb in list(self.failure_callbacks):
            cb(failure)

    def _promote_suspect(self) -> None:
        """No peer's failure came within the grace: the collective's own failure is the cause."""
        if self.suspect is not None and self.failure is None:
            failure, since = self.suspect
            if time.monotonic() - since >= COLLECTIVE_GRACE_S:
                self.suspect = None
                failure.in_collective = False
                self._fail(failure)

    def _monitor(self) -> None:
        watcher = procs.ExitWatcher(self.procs)
        try:
            while not self.stopping:
                self._promote_suspect()
                if not watcher.procs:
                    time.sleep(0.5)
                    continue
                for rank in watcher.wait(0.5):
                    proc = watcher.procs[rank]
                    watcher.forget(rank)
                    if self.stopping or self.failure is not None:
                        continue
                    if proc.returncode > 0:
                        time.sleep(SELF_EXIT_GRACE_S)
                    self._fail(RankFailure(
                        rank=rank, node_rank=0, process=f"Worker_rank{rank}", pid=proc.pid,
                        hostname=socket.gethostname(), exc_type="ProcessExit",
                        message=f"worker rank {rank} (pid {proc.pid}) "
                                f"{procs.describe_exit(proc.returncode)}",
                        exit_code=proc.returncode))
        finally:
            watcher.close()

    # -- shutdown ---------------------------------------------------------------------------

    def abort(self) -> None:
        """Stop every rank at once (the engine is dying of its own error)."""
        self.shutdown(force=True)

    def shutdown(self, force: bool = False) -> None:
        """Stop every rank: politely after a clean run, at once after a failure."""
        if self.closed:
            return
        self.closed = True
        failed = force or self.failure is not None
        self.stopping = True
        if not failed:
            try:
                self.collective_rpc("shutdown", timeout=10)
            except Exception as exc:  # noqa: BLE001 - stopping anyway
                log.warning("workers did not confirm shutdown: %s", exc)
        procs.stop_processes(list(self.procs.values()), 0 if failed else 5)
        if self.link is not None:
            reason = ("stopped" if not failed else
                      f"dead: {self.failure.describe()}" if self.failure else "dead: engine error")
            self.link.stop_nodes(reason, exit_code=1 if failed else 0, failure=self.failure)
            self.link.close()
        self.broadcaster.close()
        self.replies.close(linger=0)
        try:
            os.unlink(f"{self.ipc_dir}/replies")
            os.rmdir(self.ipc_dir)
        except OSError:
            pass
