"""A headless node: `shoal serve MODEL --nnodes K --node-rank R --headless ...` (R > 0).

It runs no API server and no scheduler: a supervisor (this process) joins node 0 over the group
link, starts this node's workers (they join torch.distributed at master_addr:master_port and
read the step broadcast over TCP), then watches three things until the group stops:
- node 0's orders: StopNode -> the workers are stopped, exit with the code node 0 gives;
- node 0's heartbeat: silence for LINK_TIMEOUT_S -> node 0 is lost; kill the workers, exit 1;
- its workers' exits: the first one is reported to node 0 first-hand (NodeFailed), exit 1.
Every failure exit writes the termination message (rank, cause) for the operator.

SIGTERM to a headless node alone asks node 0 to shut the whole group down (ShutdownRequest):
node 0 drains or aborts by its --shutdown-timeout while this node keeps serving its shard, then
sends StopNode. If node 0 is already shutting down (a rank-ordered delete), the request changes
nothing. A second SIGTERM, or SIGINT, stops this node at once (the group then fails on node 0).
"""

from __future__ import annotations

import logging
import signal
import socket
import time

from shoal.contract.termination import Cause, write_termination_message
from shoal.engine.config import EngineConfig
from shoal.engine.core.engine_core_proc.death import NODE_LOST, death_cause
from shoal.engine.executor import procs
from shoal.engine.executor.broadcast import BroadcastHandle
from shoal.engine.executor.group_link import GroupLinkClient
from shoal.engine.executor.multiproc_executor import SELF_EXIT_GRACE_S
from shoal.engine.executor.rank_wire import (
    LINK_TIMEOUT_S,
    NODE_JOIN_TIMEOUT_S,
    NodeFailed,
    RankFailure,
    ShutdownRequest,
    StopNode,
)
from shoal.engine.executor.worker_proc import local_worker_specs

log = logging.getLogger("shoal.engine.headless")


class _Stop(Exception):
    def __init__(self, code: int) -> None:
        self.code = code


class HeadlessNode:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.node = config.node_rank
        self.ranks = list(config.local_ranks())
        self.signals = 0
        self.workers: dict = {}

    def _on_signal(self, signum, frame) -> None:
        self.signals += 1
        if signum == signal.SIGINT or self.signals > 1:
            log.warning("node %d: %s again: stopping now", self.node, signal.Signals(signum).name)
            raise _Stop(0)
        log.info("node %d: received %s: asking node 0 to shut the group down; this node serves "
                 "until node 0 has drained", self.node, signal.Signals(signum).name)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        link = GroupLinkClient(self.config)
        try:
            return self._run(link)
        except _Stop as stop:
            return stop.code
        finally:
            procs.stop_processes(list(self.workers.values()), 0)
            link.close()

    def _run(self, link: GroupLinkClient) -> int:
        cfg = self.config
        log.info("node %d of %d: joining node 0 at %s (ranks %s)", self.node, cfg.nnodes,
                 link.address, self.ranks)
        try:
            welcome = link.join(self.ranks, NODE_JOIN_TIMEOUT_S, lambda: self.signals > 0)
        except TimeoutError as exc:
            return self._fail(Cause.RANK_JOIN_TIMEOUT, str(exc))
        except RuntimeError as exc:
            return self._fail(Cause.STARTUP_ERROR, str(exc))
        if welcome is None:
            log.info("node %d: stopped before node 0 answered; nothing to drain", self.node)
            return 0
        specs = local_worker_specs(cfg, BroadcastHandle(tcp_address=welcome.broadcast_address),
                                   welcome.reply_address,
                                   f"tcp://{cfg.master_addr}:{cfg.master_port}")
        self.workers = {spec.rank: procs.spawn_worker(spec) for spec in specs}
        log.info("node %d: started workers for ranks %s (%d threads each)", self.node,
                 self.ranks, specs[0].num_threads)
        return self._watch(link)

    def _watch(self, link: GroupLinkClient) -> int:
        watcher = procs.ExitWatcher(self.workers)
        asked = False
        try:
            while True:
                for msg in link.poll(0.25):
                    if isinstance(msg, StopNode):
                        return self._stopped_by_node0(msg)
                if self.signals and not asked:
                    asked = True
                    link.send(ShutdownRequest(self.node))
                for rank in watcher.wait(0):
                    if self.workers[rank].returncode == 0:  # node 0's `shutdown` call: StopNode
                        watcher.forget(rank)                # follows on the link
                        continue
                    return self._worker_exited(link, rank)
                silent = link.silent_for()
                if silent > LINK_TIMEOUT_S:
                    return self._fail(death_cause(serving=True, exc_type=NODE_LOST),
                                      f"node 0 at {link.address} is lost: no heartbeat for "
                                      f"{silent:.1f} s (killed, or unreachable); this node "
                                      f"stops its ranks {self.ranks}", rank=0)
        finally:
            watcher.close()

    def _stopped_by_node0(self, msg: StopNode) -> int:
        log.info("node %d: node 0 stops the group (%s); exit code %d", self.node, msg.reason,
                 msg.exit_code)
        procs.stop_processes(list(self.workers.values()), 5)
        if msg.exit_code:
            root = msg.failure
            return self._fail(Cause.PEER_LOST, f"node 0 stopped the group: {msg.reason}",
                              rank=root.rank if root else 0, exit_code=msg.exit_code)
        return 0

    def _worker_exited(self, link: GroupLinkClient, rank: int) -> int:
        proc = self.workers[rank]
        if proc.returncode > 0:  # it reported its own failure to node 0 first
            time.sleep(SELF_EXIT_GRACE_S)
        failure = RankFailure(
            rank=rank, node_rank=self.node, process=f"Worker_rank{rank}", pid=proc.pid,
            hostname=socket.gethostname(), exc_type="ProcessExit",
            message=f"worker rank {rank} (pid {proc.pid}) {procs.describe_exit(proc.returncode)}",
            exit_code=proc.returncode)
        link.send(NodeFailed(failure))
        procs.stop_processes(list(self.workers.values()), 0)
        return self._fail(death_cause(serving=True, exc_type=failure.exc_type),
                          failure.describe(), rank=rank)

    def _fail(self, cause: Cause, message: str, rank: int | None = None,
              exit_code: int = 1) -> int:
        log.error("node %d: %s: %s; exiting %d", self.node, cause.value, message, exit_code)
        write_termination_message(cause, message, rank=rank, exit_code=exit_code)
        return exit_code


def run_headless(config: EngineConfig) -> int:
    return HeadlessNode(config).run()
