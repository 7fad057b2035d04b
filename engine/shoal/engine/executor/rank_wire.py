"""Everything that crosses the EngineCore <-> worker boundary, and the node 0 <-> headless
node link.

Same ABI rules as `shoal.engine.wire` (positional msgpack arrays, fields only appended, with a
default and a comment; no pickle). What travels where:
- EngineCore -> every worker, on the step broadcast (shared-memory ring locally, ZeroMQ XPUB/SUB
  over TCP to other nodes): WorkerCall. Its `args` are the method's arguments, msgpack-encoded,
  decoded by the worker with the method's own types (worker_proc.ARG_TYPES).
- worker -> EngineCore, on one PULL socket (ipc:// locally, tcp:// from other nodes): WorkerReply.
  Call id 0 is the worker's start-up report (READY, or the failure that stopped it).
- node 0 <-> each headless node, on the group link (ROUTER on node 0 at master_port + 1, a DEALER
  per headless node): LinkMessage, a tagged union. Both ends send Heartbeat every
  HEARTBEAT_INTERVAL_S; silence for LINK_TIMEOUT_S means the other node is lost.

This module imports neither torch nor zmq.
"""

from __future__ import annotations

import msgspec

HEARTBEAT_INTERVAL_S = 1.0
# A node that has not been heard from for this long is lost (the bound is 5 s).
LINK_TIMEOUT_S = 4.0
# How long node 0 waits for every headless node to join, and a headless node for node 0.
NODE_JOIN_TIMEOUT_S = 600.0
# Call id of a worker's start-up report.
STARTUP_CALL_ID = 0


class RankFailure(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Why one rank failed: the root cause a user must see (HTTP error, log, termination
    message, the operator's status). Built where the failure is known: in the worker for an
    exception, in whoever watches the process for an exit, on node 0 for a lost node."""

    rank: int  # global rank; -1 = a whole node (its ranks are listed in `message`)
    node_rank: int
    process: str  # e.g. "Worker_rank1" or "node 1"
    pid: int
    hostname: str
    exc_type: str  # the exception's class, or "ProcessExit" / "NodeLost"
    message: str
    traceback: str = ""  # tail of the traceback, when there was one
    exit_code: int | None = None  # the process's exit status; negative = killed by that signal
    # Raised inside a torch.distributed collective: most often the consequence of a peer that
    # died, so node 0 waits briefly for that peer's own failure before naming this one.
    in_collective: bool = False
    # The termination cause decided where the exception was raised
    # (core/engine_core_proc/death.py); ""
    # for exits and lost nodes, which the EngineCore names.
    cause: str = ""

    def describe(self) -> str:
        where = f"pid {self.pid} on {self.hostname}" if self.pid else self.hostname
        return (f"{self.process} (rank {self.rank}, node {self.node_rank}, {where}) failed: "
                f"{self.exc_type}: {self.message}")


class WorkerCall(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """EngineCore -> every worker: run `method(*args)`."""

    call_id: int  # > 0; replies carry it back
    method: str  # a name in worker_proc.ARG_TYPES: the broadcast is not an arbitrary-code channel
    args: msgspec.Raw = msgspec.Raw(b"\x90")  # msgpack array of the arguments (default: none)
    reply_rank: int = -1  # -1: every rank replies; else only this rank (e.g. execute_model: 0)


class WorkerReply(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Worker -> EngineCore: the result of one call, or the failure that it raised."""

    call_id: int
    rank: int
    result: msgspec.Raw = msgspec.Raw(b"\xc0")  # msgpack of the return value (default: None)
    failure: RankFailure | None = None


# ----- group link: node 0 <-> headless nodes ------------------------------------------------


class NodeHello(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="hello"):
    """Headless node -> node 0, first thing: who joins."""

    node_rank: int
    pid: int
    hostname: str
    protocol_version: int
    engine_version: str
    ranks: list[int] = []  # the global ranks this node runs


class NodeWelcome(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="welcome"):
    """Node 0 -> headless node: where to read the step broadcast and send replies."""

    broadcast_address: str  # tcp:// of node 0's XPUB
    reply_address: str  # tcp:// of node 0's PULL
    accepted: bool = True
    reason: str = ""  # why not, when refused (version mismatch, unexpected node rank)


class Heartbeat(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="heartbeat"):
    node_rank: int


class NodeFailed(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="failed"):
    """Headless node -> node 0: one of my ranks failed (the root cause, first-hand)."""

    failure: RankFailure


class StopNode(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="stop"):
    """Node 0 -> headless node: the group is stopping; stop your workers and exit."""

    reason: str  # "stopped", "dead: ..." - logged by the headless node
    exit_code: int = 0  # what the headless node exits with (1 when the group died)
    failure: RankFailure | None = None  # the group's root cause, when it died


class ShutdownRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False,
                      tag="shutdown"):
    """Headless node -> node 0: I got SIGTERM; please shut the group down (node 0 drains or
    aborts by its --shutdown-timeout, then sends StopNode)."""

    node_rank: int
    signal: str = "SIGTERM"


LinkMessage = NodeHello | NodeWelcome | Heartbeat | NodeFailed | StopNode | ShutdownRequest
