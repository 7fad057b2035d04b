"""The termination message: which process failed first, how it ended, and what vLLM said.

The culprit is the earliest of two kinds of events: a process's first exception in the log,
and the end of a vLLM process (titled `VLLM::...`, not our child) that did not exit 0 or whose
status was not seen. A killed EngineCore ends
before the API server logs anything about it; a Worker's exception is logged before its
EngineCore, the API server and the other Workers go down because of it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from shoal.contract.termination import Cause
from shoal.supervisor import rules, status
from shoal.supervisor.procwatch import TITLE_PREFIX, Proc
from shoal.supervisor.vllm_log import LogMemory, ProcLog

MAX_ROOT_LINES = 12
MAX_OTHERS = 6
STREAMS = ("stdout", "stderr")


@dataclass(frozen=True)
class Report:
    cause: Cause
    message: str
    process: str
    pid: int | None
    rank: int
    exit_code: int


def node_rank(argv: list[str]) -> int:
    """vLLM's `--node-rank N` (or `--node-rank=N`) from its command line; else 0."""
    for i, arg in enumerate(argv):
        value = argv[i + 1] if arg == "--node-rank" and i + 1 < len(argv) else \
            arg.partition("=")[2] if arg.startswith("--node-rank=") else None
        if value is not None and value.isdigit():
            return int(value)
    return 0


def exit_code_for(child_status: int) -> int:
    """Our exit code when vLLM ended without being asked: never 0."""
    code = status.exit_code(child_status)
    return code if code != 0 else 1


def process_name(proc: Proc | None, pid: int | None, log: LogMemory, child_pid: int) -> str:
    """vLLM's name for a process: its log prefix, else its title, else `APIServer` for our
    child (vllm serve's main process)."""
    if pid is not None:
        logged = log.name_of(pid)
        if logged:
            return logged
    if proc is not None and proc.title.startswith(TITLE_PREFIX):
        return proc.name
    if pid == child_pid:
        return "APIServer"
    return proc.name.split(" ")[0].rsplit("/", 1)[-1] if proc and proc.title else "process"


def _label(name: str, pid: int | None, rank: int) -> str:
    tp = re.search(r"_TP(\d+)", name)
    where = f"pid {pid}, " if pid is not None else ""
    return f"{name} ({where}rank {rank}{f', TP {tp[1]}' if tp else ''})"


def build(argv: list[str], child: Proc, log: LogMemory, ended: list[Proc]) -> Report:
    """The report for a vLLM that ended without being asked to (`child.status` is set)."""
    rank = node_rank(argv)
    by_pid = {p.pid: p for p in ended}
    events: list[tuple[float, str, object]] = []
    for plog in log.exceptions():
        events.append((plog.first_exception.at, "exception", plog))
    vllm_ended = [p for p in ended if p.pid != child.pid and p.title.startswith(TITLE_PREFIX)]
    for proc in vllm_ended:  # helpers (a compiler probe, lscpu) are not vLLM's processes
        if not status.clean(proc.status):
            events.append((proc.ended, "end", proc))
    events.sort(key=lambda e: e[0])

    if events and events[0][1] == "end":
        proc = events[0][2]
        culprit_pid, culprit_proc, culprit_log = proc.pid, proc, None
    elif events:
        culprit_log: ProcLog = events[0][2]
        culprit_pid = culprit_log.pid
        if culprit_pid is None:  # Python's own traceback, without vLLM's prefix
            culprit_pid = child.pid if culprit_log.name in STREAMS else \
                log.pid_of(culprit_log.name)  # multiprocessing's `Process NAME:` banner
        culprit_proc = child if culprit_pid == child.pid else by_pid.get(culprit_pid)
    else:
        culprit_pid, culprit_proc, culprit_log = child.pid, child, None
    name = process_name(culprit_proc, culprit_pid, log, child.pid)
    if culprit_log is not None and culprit_pid is None:
        name = culprit_log.name

    label = _label(name, culprit_pid, rank)
    ended_how = status.describe(culprit_proc.status) if culprit_proc is not None and \
        culprit_proc.ended is not None else None
    if culprit_log is None:
        lines = [f"{label} {ended_how or 'failed'}"]
    else:  # what it raised first, then how it ended (its exception, not the signal, is why)
        lines = [f"{label} failed: {culprit_log.first_exception.line}"]
        lines.extend(f"  {more}" for more in culprit_log.first_exception.more)
        if ended_how:
            lines.append(f"then {label} {ended_how}")
    if culprit_proc is not child:
        child_name = process_name(child, child.pid, log, child.pid)
        lines.append(f"then {_label(child_name, child.pid, rank)} "
                     f"{status.describe(child.status)}")
    others = [p for p in vllm_ended if p is not culprit_proc][:MAX_OTHERS]
    if others:
        lines.append("also ended: " + "; ".join(
            f"{process_name(p, p.pid, log, child.pid)} (pid {p.pid}) {status.describe(p.status)}"
            for p in others))
    root = _root_lines(log, culprit_log)
    lines.extend(root)
    if not root and culprit_log is None:
        lines.extend(f"log: {line}" for line in list(log.tail)[-4:])
    texts = root + ([culprit_log.first_exception.text()] if culprit_log else [])
    cause = _cause(culprit_proc, culprit_log, texts, log)
    return Report(cause, "\n".join(lines), name, culprit_pid, rank, exit_code_for(child.status))


def _root_lines(log: LogMemory, shown: ProcLog | None) -> list[str]:
    """What vLLM said first besides the culprit's exception (`shown`): argparse's error, each
    other process's first exception, every process's first ERROR lines (bounded)."""
    lines = [log.usage_error] if log.usage_error else []
    said = {shown.first_exception.line} if shown else set()
    for plog in log.exceptions():  # a multiprocessing child's traceback is on stderr too
        if plog.first_exception.line not in said:
            said.add(plog.first_exception.line)
            lines.append(f"{_who(plog)}: {plog.first_exception.text()}")
    for plog in log.procs.values():
        lines.extend(f"{_who(plog)}: {err}" for err in plog.errors)
    return lines[:MAX_ROOT_LINES]


def _who(plog: ProcLog) -> str:
    return plog.name + (f" pid={plog.pid}" if plog.pid is not None else "")


def _cause(proc: Proc | None, plog: ProcLog | None, texts: list[str], log: LogMemory) -> Cause:
    """A killed process is `signaled`; else the first rule matching what vLLM said; else an
    exception before vLLM served is `startup_error`, after it `engine_error`."""
    if plog is None and proc is not None and status.signaled(proc.status):
        return Cause.SIGNALED
    matched = rules.classify(texts)
    if matched is not None:
        return matched
    if plog is not None:
        return Cause.ENGINE_ERROR if log.ready else Cause.STARTUP_ERROR
    if proc is not None and status.signaled(proc.status):
        return Cause.SIGNALED
    return Cause.UNEXPECTED_EXIT
