"""The group link: node 0 and each headless node keep track of each other.

Node 0 (the EngineCore process) binds a ROUTER at `master_port + 1`; each headless node's
supervisor connects a DEALER. A headless node joins with NodeHello and learns from NodeWelcome
where the step broadcast and the reply socket are. From then on both ends send a Heartbeat every
second; silence for LINK_TIMEOUT_S means the other node is lost. The link also carries a headless
node's first-hand failure report (NodeFailed), its request to shut the group down when it gets
SIGTERM (ShutdownRequest), and node 0's order to stop (StopNode).

Node 0's end runs on its own thread once the group has joined; the headless end is polled by the
supervisor's main loop. Neither touches the step broadcast: a stuck step cannot hide a lost node.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections.abc import Callable

import msgspec
import zmq
from shoal.engine import __version__ as ENGINE_VERSION
from shoal.engine.config import EngineConfig
from shoal.engine.executor.rank_wire import (
    HEARTBEAT_INTERVAL_S,
    LINK_TIMEOUT_S,
    Heartbeat,
    LinkMessage,
    NodeFailed,
    NodeHello,
    NodeWelcome,
    RankFailure,
    ShutdownRequest,
    StopNode,
)
from shoal.engine.wire import PROTOCOL_VERSION

log = logging.getLogger("shoal.engine.group_link")
PROGRESS_EVERY_S = 10.0
_decoder = msgspec.msgpack.Decoder(LinkMessage)


def link_port(config: EngineConfig) -> int:
    return config.master_port + 1


class GroupLinkServer:
    """Node 0's end. `wait_for_nodes` (caller's thread), then `start()` the watch thread."""

    def __init__(self, config: EngineConfig, on_failure: Callable[[RankFailure], None],
                 on_shutdown_request: Callable[[ShutdownRequest], None]) -> None:
        self.config = config
        self.on_failure = on_failure
        self.on_shutdown_request = on_shutdown_request
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.address = f"{config.master_addr}:{link_port(config)}"
        self.sock.bind(f"tcp://*:{link_port(config)}")
        self.nodes: dict[int, tuple[bytes, NodeHello]] = {}  # node rank -> (identity, hello)
        self.last_seen: dict[int, float] = {}
        self.commands: queue.Queue = queue.Queue()
        self.closed = threading.Event()
        self.thread: threading.Thread | None = None

    def wait_for_nodes(self, welcome: NodeWelcome, timeout: float,
                       alive: Callable[[], None] = lambda: None) -> None:
        """Admit every headless node; `alive()` raises to give up (a local rank died)."""
        expected = set(range(1, self.config.nnodes))
        started = last_note = time.monotonic()
        while expected - set(self.nodes):
            alive()
            now = time.monotonic()
            missing = sorted(expected - set(self.nodes))
            if now - started > timeout:
                raise TimeoutError(f"node(s) {missing} of {self.config.nnodes} did not join at "
                                   f"{self.address} within {timeout:.0f} s")
            if now - last_note >= PROGRESS_EVERY_S:
                last_note = now
                log.info("waiting for node %d of %d at %s, %.0f s (timeout %.0f s)", missing[0],
                         self.config.nnodes, self.address, now - started, timeout)
            if not self.sock.poll(250):
                continue
            ident, body = self.sock.recv_multipart()
            msg = _decoder.decode(body)
            if isinstance(msg, NodeHello):
                self._admit(ident, msg, welcome)

    def _admit(self, ident: bytes, hello: NodeHello, welcome: NodeWelcome) -> None:
        reason = ""
        if hello.protocol_version != PROTOCOL_VERSION:
            reason = (f"protocol mismatch: node 0 speaks v{PROTOCOL_VERSION} (shoal "
                      f"{ENGINE_VERSION}), node {hello.node_rank} v{hello.protocol_version} "
                      f"(shoal {hello.engine_version})")
        elif not 0 < hello.node_rank < self.config.nnodes or hello.node_rank in self.nodes:
            reason = f"unexpected node rank {hello.node_rank} (nnodes {self.config.nnodes})"
        if reason:
            log.error("refused node %d (%s): %s", hello.node_rank, hello.hostname, reason)
            self._send(ident, NodeWelcome("", "", accepted=False, reason=reason))
            return
        self.nodes[hello.node_rank] = (ident, hello)
        self.last_seen[hello.node_rank] = time.monotonic()
        log.info("node %d joined from %s (pid %d, ranks %s)", hello.node_rank, hello.hostname,
                 hello.pid, hello.ranks)
        self._send(ident, welcome)

    def start(self) -> None:
        now = time.monotonic()
        for node in self.last_seen:
            self.last_seen[node] = now
        self.thread = threading.Thread(target=self._run, name="group-link", daemon=True)
        self.thread.start()

    def stop_nodes(self, reason: str, exit_code: int, failure: RankFailure | None = None,
                   wait: float = 2.0) -> None:
        """Tell every headless node to stop (from any thread); returns once sent (or `wait`)."""
        done = threading.Event()
        self.commands.put((StopNode(reason, exit_code, failure), done))
        if self.thread is None or not self.thread.is_alive():
            self._flush_commands()
        done.wait(wait)

    def close(self) -> None:
        self.closed.set()
        if self.thread is not None:
            self.thread.join(timeout=3)
        self.sock.close(linger=500)

    def _send(self, ident: bytes, msg) -> None:
        self.sock.send_multipart([ident, msgspec.msgpack.encode(msg)])

    def _flush_commands(self) -> None:
        while True:
            try:
                msg, done = self.commands.get_nowait()
            except queue.Empty:
                return
            for ident, _ in self.nodes.values():
                self._send(ident, msg)
            done.set()

    def _run(self) -> None:
        next_beat = 0.0
        lost: set[int] = set()
        while not self.closed.is_set():
            if self.sock.poll(200):
                ident, body = self.sock.recv_multipart()
                self._handle(ident, _decoder.decode(body))
            self._flush_commands()
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + HEARTBEAT_INTERVAL_S
                for ident, _ in self.nodes.values():
                    self._send(ident, Heartbeat(0))
            for node, seen in self.last_seen.items():
                if node not in lost and now - seen > LINK_TIMEOUT_S:
                    lost.add(node)
                    self.on_failure(self._lost(node, now - seen))

    def _handle(self, ident: bytes, msg) -> None:
        if isinstance(msg, Heartbeat):
            self.last_seen[msg.node_rank] = time.monotonic()
        elif isinstance(msg, NodeFailed):
            self.on_failure(msg.failure)
        elif isinstance(msg, ShutdownRequest):
            log.info("node %d asks the group to shut down (%s)", msg.node_rank, msg.signal)
            self.on_shutdown_request(msg)
        elif isinstance(msg, NodeHello):  # a node restarted alone: the group must restart whole
            self._send(ident, NodeWelcome("", "", accepted=False,
                                          reason="the group is already running; a lost node "
                                                 "restarts with the whole group"))

    def _lost(self, node: int, silent: float) -> RankFailure:
        _, hello = self.nodes[node]
        first = hello.ranks[0] if hello.ranks else -1
        return RankFailure(
            rank=first, node_rank=node, process=f"node {node}", pid=hello.pid,
            hostname=hello.hostname, exc_type="NodeLost",
            message=f"no heartbeat from node {node} ({hello.hostname}, ranks {hello.ranks}) for "
                    f"{silent:.1f} s: the node or its supervisor died, or the network to it is "
                    "down")


class GroupLinkClient:
    """A headless node's end, polled by its supervisor's loop."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, f"node{config.node_rank}".encode())
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.address = f"{config.master_addr}:{link_port(config)}"
        self.sock.connect(f"tcp://{self.address}")
        self.last_seen = time.monotonic()
        self.next_beat = 0.0

    def join(self, ranks: list[int], timeout: float,
             cancelled: Callable[[], bool] = lambda: False) -> NodeWelcome | None:
        """Wait for node 0's welcome; None if `cancelled()` becomes true first."""
        import os

        hello = NodeHello(self.config.node_rank, os.getpid(), socket.gethostname(),
                          PROTOCOL_VERSION, ENGINE_VERSION, ranks)
        self.send(hello)
        started = last_note = time.monotonic()
        while not cancelled():
            now = time.monotonic()
            if now - started > timeout:
                raise TimeoutError(f"node 0 did not answer at {self.address} within "
                                   f"{timeout:.0f} s")
            if now - last_note >= PROGRESS_EVERY_S:
                last_note = now
                log.info("node %d: waiting for node 0 at %s, %.0f s (timeout %.0f s)",
                         self.config.node_rank, self.address, now - started, timeout)
            if self.sock.poll(250):
                msg = _decoder.decode(self.sock.recv())
                if isinstance(msg, NodeWelcome):
                    if not msg.accepted:
                        raise RuntimeError(f"node 0 refused node {self.config.node_rank}: "
                                           f"{msg.reason}")
                    self.last_seen = time.monotonic()
                    return msg
        return None

    def poll(self, timeout: float) -> list:
        """Messages from node 0 within `timeout`; sends this node's heartbeat when due."""
        now = time.monotonic()
        if now >= self.next_beat:
            self.next_beat = now + HEARTBEAT_INTERVAL_S
            self.send(Heartbeat(self.config.node_rank))
        out = []
        if self.sock.poll(int(timeout * 1000)):
            while self.sock.poll(0):
                out.append(_decoder.decode(self.sock.recv()))
            self.last_seen = time.monotonic()
        return out

    def silent_for(self) -> float:
        return time.monotonic() - self.last_seen

    def send(self, msg) -> None:
        self.sock.send(msgspec.msgpack.encode(msg))

    def close(self) -> None:
        self.sock.close(linger=1000)
