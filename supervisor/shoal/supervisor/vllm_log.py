"""vLLM's log: passed through byte for byte, with a bounded memory of what names the fault.

vLLM prefixes each log line with the process that wrote it, `(APIServer pid=7)`,
`(EngineCore_DP0 pid=40)`, `(Worker_TP0 pid=52)` (vllm/logger.py, `_FORMAT`), and repeats the
prefix on every line of a multi-line record (NewLineFormatter: `\\r\\n` + prefix). Python's own
tracebacks (an uncaught exception, multiprocessing's `Process EngineCore_DP0:`) come without it.
Per process this keeps the FIRST exception (the first traceback's final `SomeError: text` line
and its indented continuation, e.g. pydantic's `Value error, ...`), the first few ERROR lines
(`EngineCore failed to start.`), argparse's `error:` line, and a small tail; nothing grows
without bound. The last traceback line, which Kubernetes' log tail shows, is usually a
consequence (`Engine core initialization failed. See root cause above.`).
"""

from __future__ import annotations

import collections
import re
import time
from dataclasses import dataclass, field

ANSI = re.compile(r"\x1b\[[0-9;]*m")
PREFIX = re.compile(r"\((?P<name>[A-Za-z][\w-]*) pid=(?P<pid>\d+)\) ?")
# After the prefix: `ERROR 12-02 04:00:00 [core.py:1510] message`.
RECORD = re.compile(r"(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) [\d-]+ [\d:]+ \[[^\]]*\] "
                    r"(?P<msg>.*)")
TRACEBACK = "Traceback (most recent call last):"
# A traceback's final line: `ValueError: text`, `pkg.mod.SomeError: text`, or a bare name.
EXCEPTION = re.compile(r"(?P<type>[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Failure|"
                       r"Fault|Warning)?)(: (?P<text>.*))?$")
PROCESS_BANNER = re.compile(r"Process (?P<name>[\w-]+):$")  # multiprocessing's traceback header
USAGE_ERROR = re.compile(r"[\w. /-]+: error: .*")  # argparse, printed before exit 2
READY = ("Application startup complete.", "Starting vLLM server on ")  # it serves

MAX_LINE = 1000  # characters kept of one line (the stream itself passes whole)
MAX_PENDING = 16384  # bytes of an unfinished line kept for analysis
MAX_ERRORS = 4  # ERROR lines kept per process
MAX_CONTINUATION = 4  # indented lines kept after an exception line
MAX_PROCESSES = 64
TAIL_LINES = 12


@dataclass
class Exc:
    """The first exception of one process, and when its final line arrived."""

    line: str
    at: float
    seq: int
    more: list[str] = field(default_factory=list)

    def text(self) -> str:
        return "\n".join([self.line, *self.more])


@dataclass
class ProcLog:
    """What one process (by its log prefix, or a stream for unprefixed lines) said."""

    name: str
    pid: int | None
    first_exception: Exc | None = None
    errors: list[str] = field(default_factory=list)
    # Parser state of the traceback being read (None: not in one).
    in_traceback: bool = False
    continuing: Exc | None = None


class LogMemory:
    """Feed it the child's bytes per stream; ask it what each process said first."""

    def __init__(self) -> None:
        self.procs: dict[tuple[str, int | None], ProcLog] = {}
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.usage_error: str | None = None
        self.ready = False
        self._pending: dict[str, bytes] = {}
        self._banner: dict[str, str] = {}  # stream -> process named by `Process NAME:`
        self._seq = 0

    def feed(self, stream: str, data: bytes) -> None:
        buf = self._pending.get(stream, b"") + data
        *lines, rest = buf.split(b"\n")
        for raw in lines:
            self.line(stream, raw.decode(errors="replace"))
        self._pending[stream] = rest[-MAX_PENDING:]

    def close(self, stream: str) -> None:
        rest = self._pending.pop(stream, b"")
        if rest:
            self.line(stream, rest.decode(errors="replace"))

    def line(self, stream: str, text: str) -> None:
        """One line of `stream` ('stdout' or 'stderr')."""
        text = ANSI.sub("", text.rstrip("\r"))[:MAX_LINE]
        if not text.strip():
            return
        self._seq += 1
        self.tail.append(text)
        match = PREFIX.search(text)
        if match and match.start() <= 40:  # VLLM_LOGGING_PREFIX may come first
            proc = self._proc(match["name"], int(match["pid"]))
            body = text[match.end():]
            record = RECORD.match(body)
            if record:
                body = record["msg"]
                if record["level"] in ("ERROR", "CRITICAL") and len(proc.errors) < MAX_ERRORS \
                        and _message_line(body) and not proc.in_traceback:
                    proc.errors.append(body.strip())
        else:
            banner = PROCESS_BANNER.match(text)
            if banner:
                self._banner[stream] = banner["name"]
                return
            proc = self._proc(self._banner.get(stream, stream), None)
            body = text
            if USAGE_ERROR.fullmatch(body) and self.usage_error is None:
                self.usage_error = body
        if any(marker in body for marker in READY):
            self.ready = True
        self._traceback(proc, body, stream)

    def _traceback(self, proc: ProcLog, body: str, stream: str) -> None:
        if body == TRACEBACK or body.endswith(TRACEBACK):
            proc.in_traceback, proc.continuing = True, None
            return
        if proc.continuing is not None:
            if body.startswith((" ", "\t")) and len(proc.continuing.more) < MAX_CONTINUATION:
                proc.continuing.more.append(body.strip())
                return
            proc.continuing = None
        if not proc.in_traceback or body.startswith((" ", "\t")):
            return
        if body.startswith(("The above exception", "During handling of")):
            return
        if EXCEPTION.match(body):
            proc.in_traceback = False
            self._banner.pop(stream, None)
            if proc.first_exception is None:
                proc.first_exception = Exc(body.strip(), time.monotonic(), self._seq)
                proc.continuing = proc.first_exception

    def _proc(self, name: str, pid: int | None) -> ProcLog:
        key = (name, pid)
        proc = self.procs.get(key)
        if proc is None:
            if len(self.procs) >= MAX_PROCESSES:  # keep the first ones: they hold the cause
                return ProcLog(name, pid)
            proc = self.procs[key] = ProcLog(name, pid)
        return proc

    def name_of(self, pid: int) -> str | None:
        """The name vLLM's log prefix gives `pid` (`EngineCore_DP0`), if it logged: the latest,
        since a Worker logs as `VllmWorker-0` before it names itself `Worker_TP0`."""
        names = [name for name, logged_pid in self.procs if logged_pid == pid]
        return names[-1] if names else None

    def pid_of(self, name: str) -> int | None:
        """The pid vLLM's log prefix gives process `name`, if it logged."""
        for logged, pid in self.procs:
            if logged == name and pid is not None:
                return pid
        return None

    def exceptions(self) -> list[ProcLog]:
        """Processes with an exception, first raised first."""
        return sorted((p for p in self.procs.values() if p.first_exception),
                      key=lambda p: p.first_exception.seq)


def _message_line(body: str) -> bool:
    """A record's own first line, not a line of the traceback it carries."""
    return bool(body.strip()) and not body.startswith((" ", "\t")) and TRACEBACK not in body
