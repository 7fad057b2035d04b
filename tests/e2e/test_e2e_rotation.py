"""Two groups behind one frontend, on real pods: when one group's engine dies, requests keep
succeeding on the other; the dead group leaves the frontend's rotation within seconds and is
used again soon after it is Ready. (Found on a real cluster: the frontend learned of a death
only as the group came back, and of its return ~70 s later.)"""

from __future__ import annotations

import threading
import time

import pytest
from support.wait import wait_for

from e2e.e2e_helpers import (
    completes,
    create,
    frontend_metrics,
    group_metric,
    record,
    service_url,
    status,
    wait_ready,
    wait_serving,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
KILL = ("import os, signal\n"
        "pids = [int(p) for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid() and "
        "b'engine_core_proc' in open(f'/proc/{p}/cmdline', 'rb').read()]\n"
        "[os.kill(p, signal.SIGKILL) for p in pids]\n")


class Load(threading.Thread):
    """Short completions one after another: (monotonic time, succeeded) per request."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.results, self.stop = url, [], threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.results.append((time.monotonic(), completes(self.url)))


def test_a_dead_group_leaves_rotation_and_comes_back(cluster, new_ns):
    ns = new_ns("e2e-rot")
    name = "rot"
    create(cluster, ns, name, replicas=2, backoff_base=2)
    wait_ready(cluster, ns, name, "2/2")
    url = service_url(cluster, ns, name)
    wait_serving(url)
    load = Load(url)
    load.start()
    try:
        wait_for(lambda: len(load.results) >= 10, timeout=60, what="requests flowing")
        cluster.kubectl("exec", "-n", ns, f"{name}-g0-r0", "-c", "engine", "--", "python3", "-c",
                        KILL)
        t_kill = time.monotonic()
        # Group 0 is recreated after its backoff and becomes Ready again.
        wait_for(lambda: status(cluster, ns, name).get("restartCount", 0) >= 1, timeout=60,
                 interval=0.5, what="the death recorded")
        wait_ready(cluster, ns, name, "2/2")
        t_back = time.monotonic()
        before = group_metric(frontend_metrics(cluster, ns, name), "shoal_router_requests_total", 0)
        wait_for(lambda: group_metric(frontend_metrics(cluster, ns, name),
                                      "shoal_router_requests_total", 0) > before,
                 timeout=30, interval=0.5, what="group 0 serving requests again")
        back_in_rotation = time.monotonic() - t_back
    finally:
        load.stop.set()
        load.join(60)
    after_kill = [(t, ok) for t, ok in load.results if t >= t_kill]
    failed = [t - t_kill for t, ok in after_kill if not ok]
    healthy_rotation = max(failed, default=0.0)
    record("kill_to_healthy_rotation", healthy_rotation, failed=len(failed),
           requests=len(after_kill))
    record("ready_to_back_in_rotation", back_in_rotation)
    assert len(after_kill) >= 10, "too few requests during the outage to say anything"
    assert len(failed) <= 1, \
        f"{len(failed)} of {len(after_kill)} requests failed after the kill: {failed}"
    assert healthy_rotation <= 10, f"requests still failed {healthy_rotation:.1f}s after the kill"
    assert back_in_rotation <= 15, f"group 0 took {back_in_rotation:.0f}s to get requests again"
