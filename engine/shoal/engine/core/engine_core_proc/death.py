"""A death's report and its cause: the one function that decides a termination cause.

Who holds what: the process that raised an exception holds its class (a ConfigError at
start-up is permanent, the same class after serving is not); a report of a death that crossed a
process boundary (a rank's RankFailure, an EngineDead) holds the class name and, from a process
that decided one, the cause it stated. `death_cause` takes either and decides once, for the
engine process, each worker rank (executor/worker_proc.py) and the frontend, which writes the
termination message too (its copy wins in a pod, and the two must agree). Nothing here reads an
error's text. Torch- and zmq-free: the frontend and the workers import it.

A headless node's supervisor (executor/headless.py) takes its deaths from here too: a worker's
exit and node 0's silence (NODE_LOST) are reports like any other. Three of its exits are not
deaths of a process at all, and it names them itself: the join never completed (a timeout is
`rank_join_timeout`, node 0 refusing the node is `startup_error`), and node 0 ordering the
group down after a failure elsewhere (`peer_lost`: this node is the consequence, and the root
cause is node 0's own report). Folding those into `death_cause` would need a fake exception
per situation and would say nothing the call site does not already say.
"""

from __future__ import annotations

import os
import socket
import traceback

from shoal.contract.termination import Cause
from shoal.engine import wire
from shoal.engine.errors import ConfigError, ModelNotFoundError

# Exception class names that mean memory ran out (torch's is torch.OutOfMemoryError).
OOM_TYPES = frozenset({"MemoryError", "OutOfMemoryError"})
# A report's exc_type for a node of a multi-node group that went away (executor/group_link.py).
NODE_LOST = "NodeLost"


def death_cause(exc: BaseException | None = None, *, serving: bool, exc_type: str = "",
                stated: str = "") -> Cause:
    """The termination cause of a death, from the exception (`exc`, where it was raised) or a
    report of one (`exc_type`, and the cause the dying process `stated`, if it did).

    `serving`: start-up had finished (the engine answered its first step); before that, only the
    classes that say so are permanent, after it nothing is."""
    if stated:
        return Cause(stated)
    name = type(exc).__name__ if exc is not None else exc_type
    if name in OOM_TYPES:
        return Cause.OUT_OF_MEMORY
    if name == NODE_LOST:
        return Cause.PEER_LOST
    if not serving:
        if isinstance(exc, ModelNotFoundError):
            return Cause.MODEL_NOT_FOUND
        if isinstance(exc, ConfigError):
            return Cause.CONFIG_ERROR
        return Cause.STARTUP_ERROR
    return Cause.ENGINE_ERROR


def engine_dead(exc: BaseException, *, process: str, rank: int, serving: bool) -> wire.EngineDead:
    """The EngineDead the engine process sends for the exception that ends it. A rank that failed
    first (WorkerFailedError carries its RankFailure) is the root cause, named as such."""
    failure = getattr(exc, "failure", None)
    if failure is not None:
        return wire.EngineDead(
            process=failure.process, pid=failure.pid, rank=failure.rank,
            exc_type=failure.exc_type, message=failure.message, traceback=failure.traceback,
            hostname=failure.hostname, node_rank=failure.node_rank,
            cause=death_cause(serving=serving, exc_type=failure.exc_type,
                              stated=failure.cause).value)
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return wire.EngineDead(
        process=process, pid=os.getpid(), rank=rank, exc_type=type(exc).__name__,
        message=str(exc) or repr(exc), traceback=tb, hostname=socket.gethostname(),
        cause=death_cause(exc, serving=serving).value)


def write_dead_termination(dead: wire.EngineDead) -> bool:
    """Write the Kubernetes termination message for a death; never raises. An EngineDead the
    frontend made for an engine that could not send one (killed by a signal) states no cause:
    it is an engine error."""
    try:
        from shoal.contract.termination import write_termination_message

        cause = death_cause(serving=True, exc_type=dead.exc_type, stated=dead.cause)
        return write_termination_message(cause, f"{dead.describe()}\n{dead.traceback}".strip(),
                                         rank=dead.rank, exit_code=1)
    except Exception:  # noqa: BLE001 - a failure path must not mask the original error
        return False
