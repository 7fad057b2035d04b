"""`make test`: the whole suite as two pytest processes side by side, the e2e tier and every
other tier (unit, process, k8s).

Why two: the e2e tier is real pods on the local cluster, and most of its 22 minutes is waiting
on Kubernetes (back-offs, grace periods, an alert's `for: 1m`, a lost node's bound) while its
own process used 2 minutes of CPU; the other tiers are 22 minutes of this machine's CPU. One
after the other they took 45 minutes (2,677 s of pytest, 2026-12-07), over the 40-minute
budget of a warm run. They share nothing that one run changes: the e2e tier has its own
cluster (API server on 6443, nodes in their own network namespaces), the k8s tier its own
control plane on free ports, and the caches both read are built under file locks.

The other tiers print as usual; the e2e tier's output goes to a file, printed whole when it
ends (two progress lines interleaved cannot be read). Each ends with its slowest steps. The exit
status is 0 when both passed (or one selected no test: PYTEST_ARGS naming one area), else the
first failing one's.

    python tests/support/run_suite.py [pytest args...]
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

NO_TESTS = 5  # pytest's exit status when nothing was selected


def pytest(marker: str, durations: int, args: list[str], **kw) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", marker, f"--durations={durations}", *args]
    return subprocess.Popen(cmd, start_new_session=True, **kw)


def main(args: list[str]) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # stop both
    t0 = time.monotonic()
    with tempfile.NamedTemporaryFile("w+", prefix="shoal-e2e-tier-", suffix=".log") as log:
        print(f"e2e tier: started alongside the other tiers; its output: {log.name}", flush=True)
        e2e = pytest("e2e", 15, args, stdout=log, stderr=subprocess.STDOUT)
        rest = pytest("not e2e", 30, args)
        try:
            rest_rc = rest.wait()
            if e2e.poll() is None:
                print(f"\nother tiers done in {time.monotonic() - t0:.0f} s; waiting for the "
                      "e2e tier", flush=True)
            e2e_rc = e2e.wait()
        except BaseException:  # interrupted (Ctrl-C, CI's timeout): stop both, their children
            for p in (e2e, rest):
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGINT)
            for p in (e2e, rest):
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
            raise
        finally:
            log.seek(0)
            print(f"\n{'=' * 30} e2e tier (ran alongside) {'=' * 30}", flush=True)
            sys.stdout.write(log.read())
    print(f"\nwhole suite: {time.monotonic() - t0:.0f} s; unit/process/k8s tiers exit "
          f"{rest_rc}, e2e tier exit {e2e_rc}", flush=True)
    codes = [rc for rc in (rest_rc, e2e_rc) if rc != NO_TESTS]
    if not codes:
        return NO_TESTS
    return next((rc for rc in codes if rc != 0), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
