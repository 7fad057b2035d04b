"""The supervisor's loop: one thread polling the child's pipes, the pidfds of vLLM's
processes, and a signal wake-up pipe; a /proc scan every SCAN_S."""

from __future__ import annotations

import os
import select
import signal
import sys
import time

from shoal.contract.termination import Cause, write_termination_message
from shoal.supervisor import reaper, report, status
from shoal.supervisor.child import Child
from shoal.supervisor.procwatch import Proc, ProcWatch
from shoal.supervisor.vllm_log import LogMemory

SCAN_S = 0.5
# After our child ends, how long its descendants may still hold the pipes open.
DRAIN_S = 5.0
REAP_GRACE_S = 0.2  # after the last pipe closed


def write_all(fd: int, data: bytes) -> None:
    while data:
        try:
            data = data[os.write(fd, data):]
        except BrokenPipeError:
            return


def run(argv: list[str], termination_log: str) -> int:
    """Run `argv` to its end; return our exit code (docs/vllm-runtime.md, "The supervisor")."""
    reaper.set_subreaper()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake the poll
    try:
        child = Child(argv)
    except OSError as exc:
        message = f"cannot start {argv[0]!r}: {exc}"
        print(f"shoal-supervisor: {message}", file=sys.stderr, flush=True)
        write_termination_message(Cause.CONFIG_ERROR, message, exit_code=127,
                                  path=termination_log, process=argv[0])
        return 127
    child.install()
    watch = ProcWatch(os.getpid())
    log = LogMemory()
    child_proc = loop(child, watch, log, wake_r)
    return finish(child, child_proc, watch, log, termination_log)


def loop(child: Child, watch: ProcWatch, log: LogMemory, wake_r: int) -> Proc:
    """Pass the child's streams through and watch its processes until it has ended and its
    pipes are closed (or DRAIN_S after it ended); the child's record."""
    pipes = child.streams()
    for fd in pipes:
        os.set_blocking(fd, False)
    child_proc: Proc | None = None
    poller = select.poll()
    poller.register(wake_r, select.POLLIN)
    for fd in pipes:
        poller.register(fd, select.POLLIN)
    polled = set()
    next_scan = 0.0
    drain_until = None
    while pipes or child.status is None:
        now = time.monotonic()
        if drain_until is not None and now >= drain_until:
            break
        if now >= next_scan:
            watch.scan()
            watch.gone()
            next_scan = now + SCAN_S
        for fd in set(watch.fds()) - polled:
            poller.register(fd, select.POLLIN)
            polled.add(fd)
        timeout = max(0.0, next_scan - time.monotonic())
        if drain_until is not None:
            timeout = min(timeout, max(0.0, drain_until - time.monotonic()))
        # pidfds first: a zombie's exit status is there only until its parent reaps it.
        for fd, _ in sorted(poller.poll(timeout * 1000), key=lambda e: e[0] not in polled):
            if fd == wake_r:
                try:
                    os.read(wake_r, 4096)
                except BlockingIOError:
                    pass
            elif fd in pipes:
                name, out = pipes[fd]
                try:
                    data = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                if data:
                    write_all(out, data)
                    log.feed(name, data)
                else:
                    log.close(name)
                    poller.unregister(fd)
                    del pipes[fd]
            elif fd in polled:
                poller.unregister(fd)
                polled.discard(fd)
                watch.readable(fd)
        for pid, wstatus in reaper.reap():
            proc = watch.reaped(pid, wstatus, os.getpid())
            if pid == child.pid:
                child.reaped(wstatus)
                child_proc = proc
                drain_until = time.monotonic() + DRAIN_S
        for fd in polled - set(watch.fds()):  # closed by watch.reaped
            poller.unregister(fd)
            polled.discard(fd)
    # An orphan's pipes close a moment before it becomes a zombie (seen in CI: its status was
    # lost and the report named the API server instead): reap what ends just after them.
    end = time.monotonic() + REAP_GRACE_S
    while time.monotonic() < end:
        for pid, wstatus in reaper.reap():
            watch.reaped(pid, wstatus, os.getpid())
        time.sleep(0.02)
    for name in ("stdout", "stderr"):
        log.close(name)
    return child_proc


def finish(child: Child, child_proc: Proc, watch: ProcWatch, log: LogMemory,
           termination_log: str) -> int:
    if child.asked_to_stop:
        return status.exit_code(child.status)
    if child_proc.title == "":
        child_proc.title = " ".join(child.argv)
    rep = report.build(child.argv, child_proc, log, watch.ended())
    write_termination_message(rep.cause, rep.message, rank=rep.rank, exit_code=rep.exit_code,
                              path=termination_log, process=rep.process, pid=rep.pid)
    print(f"shoal-supervisor: {rep.cause.value}: {rep.message}", file=sys.stderr, flush=True)
    return rep.exit_code
