"""Every descendant of the supervisor, its title, and how it ended.

vLLM's processes (`VLLM::EngineCore`, `VLLM::Worker_TP0`: setproctitle titles) are reaped by
their own parents, so their exit status never reaches us through plain waitpid. Two ways:
- traced (shoal.supervisor.tracer, PTRACE_SEIZE once a process has its VLLM:: title): its end
  is reported to our waitpid before its parent's, always;
- else a pidfd: readable when the process ends; /proc/PID/stat of the zombie then still holds
  field 52 (exit_code, in waitpid's format) until the parent reaps it. That is a race with the
  parent: what was seen is recorded, a lost race says "exit status not seen" (status None).
Statuses we reap ourselves (our child, orphans, tracees) are recorded from waitpid.
"""

from __future__ import annotations

import errno
import os
import time
from dataclasses import dataclass

from shoal.supervisor import tracer

TITLE_PREFIX = "VLLM::"


@dataclass
class Proc:
    """One descendant. `status` is waitpid's format, None while alive or when not seen."""

    pid: int
    ppid: int
    starttime: str
    title: str
    ended: float | None = None  # monotonic time its end was seen
    status: int | None = None
    seen_by: str = ""  # "waitpid", "zombie" or "" (lost the race)
    traced: bool = False  # shoal.supervisor.tracer: its end is reported to us first

    @property
    def name(self) -> str:
        """The title without vLLM's `VLLM::` prefix (`EngineCore`, `Worker_TP0`)."""
        if self.title.startswith(TITLE_PREFIX):
            return self.title[len(TITLE_PREFIX):].split(" ", 1)[0]
        return self.title


def read_stat(pid: int, fd: int | None = None) -> tuple[str, list[str]] | None:
    """(comm, fields from field 3 on) of /proc/PID/stat (through `fd`, that file held open,
    when given); None when the pid is gone."""
    try:
        if fd is not None:
            raw = os.pread(fd, 4096, 0).decode(errors="replace")
        else:
            with open(f"/proc/{pid}/stat", "rb") as f:
                raw = f.read().decode(errors="replace")
    except OSError:
        return None
    if not raw:
        return None
    head, _, rest = raw.rpartition(")")
    return head.partition("(")[2], rest.split()


def read_title(pid: int, comm: str) -> str:
    """/proc/PID/cmdline as one line (setproctitle writes the title there), else comm."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return comm
    title = raw.replace(b"\0", b" ").decode(errors="replace").strip()
    return title or comm


# pidfd_open's PIDFD_THREAD (Linux 6.9, == O_EXCL): readable when the leader THREAD has exited.
# A killed multi-threaded process (vLLM's EngineCore) shows its leader as a zombie, exit_code
# set, while its other threads still tear down; its parent is told only after the last one. So
# the leader's pidfd wakes us before the parent can reap, and the race is won more often.
PIDFD_THREAD = os.O_EXCL


def open_pidfd(pid: int) -> int:
    """A pidfd for `pid`'s leader thread where the kernel has them, else for the process."""
    try:
        return os.pidfd_open(pid, PIDFD_THREAD)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return os.pidfd_open(pid)


def field(fields: list[str], number: int) -> str:
    """stat field `number` as man proc(5) counts (fields start at 3 after comm)."""
    return fields[number - 3] if len(fields) > number - 3 else ""


class ProcWatch:
    """Descendants of `root`, scanned from /proc; their ends seen through pidfds."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.procs: dict[int, Proc] = {}
        self._fds: dict[int, int] = {}  # pidfd -> pid
        self._stat_fds: dict[int, int] = {}  # pid -> its /proc/PID/stat, held open
        self.pidfd = hasattr(os, "pidfd_open")

    def scan(self) -> None:
        """Find new descendants and refresh the titles of live ones (a spawned process sets
        its title after it starts)."""
        parents: dict[int, int] = {}
        stats = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            stat = read_stat(int(entry))
            if stat is None:
                continue
            pid = int(entry)
            stats[pid] = stat
            try:
                parents[pid] = int(field(stat[1], 4))
            except ValueError:
                continue
        for pid in sorted(parents):
            if not self._descends(pid, parents) or pid == self.root:
                continue
            comm, fields = stats[pid]
            known = self.procs.get(pid)
            if known is not None and known.starttime == field(fields, 22):
                if known.ended is None and field(fields, 3) != "Z":
                    known.title = read_title(pid, comm)
                    self._trace(known)
                continue
            self._track(Proc(pid, parents[pid], field(fields, 22), read_title(pid, comm)))

    def _descends(self, pid: int, parents: dict[int, int]) -> bool:
        seen = set()
        while pid in parents and pid not in seen:
            seen.add(pid)
            pid = parents[pid]
            if pid == self.root:
                return True
        return False

    def _trace(self, proc: Proc) -> None:
        """vLLM's own processes (titled `VLLM::`; not our child, whose status we reap anyway)
        are traced, so that their exit status comes to us before their parent."""
        if not proc.traced and proc.title.startswith(TITLE_PREFIX):
            proc.traced = tracer.seize(proc.pid)

    def _track(self, proc: Proc) -> None:
        self.procs[proc.pid] = proc
        self._trace(proc)
        if not self.pidfd:
            return
        try:
            fd = open_pidfd(proc.pid)
        except OSError:  # already gone, or a kernel before 5.3
            return
        self._fds[fd] = proc.pid
        try:  # held open: one read, no path lookup, once the race has started
            self._stat_fds[proc.pid] = os.open(f"/proc/{proc.pid}/stat", os.O_RDONLY)
        except OSError:
            pass

    def fds(self) -> list[int]:
        return list(self._fds)

    def readable(self, fd: int) -> None:
        """The pidfd's process ended: read its zombie's exit status before its parent reaps."""
        pid = self._fds.pop(fd)
        stat_fd = self._stat_fds.pop(pid, None)
        stat = read_stat(pid, stat_fd)
        for done in (fd, stat_fd):
            if done is not None:
                os.close(done)
        proc = self.procs[pid]
        if proc.ended is None:
            proc.ended = time.monotonic()
        if stat is not None and not proc.title.startswith(TITLE_PREFIX) \
                and stat[0].startswith(TITLE_PREFIX):
            proc.title = stat[0]  # titled after our last scan: setproctitle sets comm too
        if proc.seen_by:
            self._forget(proc)
            return
        if stat is not None and field(stat[1], 22) == proc.starttime \
                and field(stat[1], 3) in ("Z", "X"):
            try:
                proc.status, proc.seen_by = int(field(stat[1], 52)), "zombie"
            except ValueError:
                pass
        self._forget(proc)

    def _forget(self, proc: Proc) -> None:
        """Ended processes that are not vLLM's (compiler runs, lscpu) are dropped: the report
        ignores them, and a long-lived vLLM must not grow our memory."""
        if proc.ended is not None and not proc.title.startswith(TITLE_PREFIX):
            self.procs.pop(proc.pid, None)

    def reaped(self, pid: int, status: int, ppid: int) -> Proc:
        """A status we reaped ourselves (our child, or an orphan): always the true one."""
        proc = self.procs.get(pid)
        if proc is None:  # ended between two scans
            proc = self.procs[pid] = Proc(pid, ppid, "", "")
        if proc.ended is None:
            proc.ended = time.monotonic()
        proc.status, proc.seen_by = status, "waitpid"
        for fd, fd_pid in list(self._fds.items()):
            if fd_pid == pid:
                del self._fds[fd]
                os.close(fd)
        stat_fd = self._stat_fds.pop(pid, None)
        if stat_fd is not None:
            os.close(stat_fd)
        self._forget(proc)  # the caller keeps the one it needs (our child)
        return proc

    def gone(self) -> None:
        """Processes that left /proc without their pidfd (no pidfd support): ended, not seen."""
        watched = set(self._fds.values())
        now = time.monotonic()
        for pid, proc in list(self.procs.items()):
            if proc.ended is None and pid not in watched and read_stat(pid) is None:
                proc.ended = now
                self._forget(proc)

    def ended(self) -> list[Proc]:
        """Ended descendants, first seen ending first."""
        return sorted((p for p in self.procs.values() if p.ended is not None),
                      key=lambda p: p.ended)
