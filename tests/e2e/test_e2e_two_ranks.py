"""A group of two ranks on two nodes (tensor parallelism 2, `nodesPerGroup: 2`, pod anti-affinity)
running Shoal's own engine: greedy output equal to one rank; killing the headless rank is named
in status (rank 1) and restarts the whole group."""

from __future__ import annotations

import time

import pytest
from support.wait import wait_for
from support.watch_log import WatchLog

from e2e.e2e_helpers import (
    MODEL,
    client,
    create,
    events,
    pods,
    record,
    service_url,
    status,
    wait_ready,
    wait_serving,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import os\nimport sys\n"]


def _greedy(url: str) -> list[str]:
    oai = client(url)
    return [oai.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0)
            .choices[0].text for p in PROMPTS]


def _engine_terminated(pod: dict) -> bool:
    """The engine has ended as the pod status says it: its container terminated, or the pod
    Succeeded/Failed (kubelet 1.20 may report only the phase of a pod it is deleting)."""
    from shoal.operator.failures import terminated_state

    return terminated_state(pod) is not None


def test_two_ranks_on_two_nodes_match_one_rank_and_restart_together(cluster, new_ns):
    ns = new_ns("e2e-tp2")
    f32 = ["--dtype", "float32"]
    create(cluster, ns, "one", extra_args=f32)
    create(cluster, ns, "tp2", tensor_parallel=2, nodes_per_group=2, extra_args=f32,
           backoff_base=1)
    wait_ready(cluster, ns, "one", "1/1")
    st = wait_ready(cluster, ns, "tp2", "1/1")
    ranks = {p["metadata"]["labels"]["shoal.dev/rank"]: p
             for p in pods(cluster, ns, "shoal.dev/engine=tp2,shoal.dev/component=engine")}
    assert sorted(ranks) == ["0", "1"]
    assert ranks["0"]["spec"]["nodeName"] != ranks["1"]["spec"]["nodeName"], \
        "anti-affinity must put the ranks on two nodes"
    one_url, tp2_url = service_url(cluster, ns, "one"), service_url(cluster, ns, "tp2")
    wait_serving(one_url)
    wait_serving(tp2_url)
    assert _greedy(tp2_url) == _greedy(one_url)

    # Kill the headless rank's engine process (tini, PID 1, then exits with 137).
    uids = {r: p["metadata"]["uid"] for r, p in ranks.items()}
    restart_log = WatchLog.pods(cluster.api_client(), ns, "shoal.dev/engine=tp2").start()
    kill = ("import os, signal\n"
            "[os.kill(int(p), signal.SIGKILL) for p in os.listdir('/proc') if p.isdigit() and "
            "int(p) not in (1, os.getpid()) and b'serve' in "
            "open(f'/proc/{p}/cmdline', 'rb').read()]\n")
    cluster.kubectl("exec", "-n", ns, "tp2-g0-r1", "-c", "engine", "--", "python3", "-c", kill,
                    check=False)
    t_kill = time.monotonic()
    lf = wait_for(lambda: (status(cluster, ns, "tp2").get("lastFailure") or {}).get("pod")
                  and status(cluster, ns, "tp2")["lastFailure"], timeout=120, interval=0.5,
                  what="lastFailure")
    assert (lf["group"], lf["rank"], lf["pod"]) == (0, 1, "tp2-g0-r1"), lf

    def both_recreated():
        now = {p["metadata"]["labels"]["shoal.dev/rank"]: p["metadata"]["uid"]
               for p in pods(cluster, ns, "shoal.dev/engine=tp2,shoal.dev/component=engine")}
        return sorted(now) == ["0", "1"] and all(now[r] != uids[r] for r in now)

    wait_for(both_recreated, timeout=180, interval=0.5, what="both ranks recreated")
    restart_log.stop()
    # No replacement started beside an old rank of the same name: each old pod went either after
    # its engine container had ended (then grace 0 is safe) or through a graceful delete, whose
    # object the kubelet removes only once the container stopped (a delete with grace 0 of a
    # live rank, as before, shows neither); its successor was created after it was gone.
    for rank in ("0", "1"):
        evs = restart_log.of(f"tp2-g0-r{rank}")
        old = [e for e in evs if e.obj["metadata"]["uid"] == uids[rank]]
        old_gone = next(e.at for e in old if e.type == "DELETED")
        ended = any(_engine_terminated(e.obj) for e in old)
        graceful = any((e.obj["metadata"].get("deletionGracePeriodSeconds") or 0) > 0 for e in old)
        new_added = next(e.at for e in evs
                         if e.type == "ADDED" and e.obj["metadata"]["uid"] != uids[rank])
        assert ended or graceful, (rank, [(e.type,
                                           e.obj["metadata"].get("deletionGracePeriodSeconds"))
                                          for e in old])
        assert old_gone <= new_added, (rank, old_gone, new_added)
    st = wait_ready(cluster, ns, "tp2", "1/1")
    assert st["restartCount"] == 1
    wait_serving(tp2_url)
    record("tp2_kill_rank1_to_serving", time.monotonic() - t_kill)
    assert _greedy(tp2_url) == _greedy(one_url)

    # Delete: rank 0 drains first; its headless rank is stopped only after rank 0's engine
    # container has terminated (it is needed for every forward pass until then).
    log = WatchLog.pods(cluster.api_client(), ns, "shoal.dev/engine=tp2").start()
    cluster.kubectl("delete", "ie", "tp2", "-n", ns, "--wait=false")
    wait_for(lambda: not pods(cluster, ns, "shoal.dev/engine=tp2,shoal.dev/component=engine"),
             timeout=180, interval=0.5, what="both ranks gone")
    log.stop()

    def first(rank: str, pred) -> float | None:
        return next((e.at for e in log.of(f"tp2-g0-r{rank}") if pred(e.obj)), None)

    # Rank 0 ended when its engine container terminated or, if the kubelet removed the pod
    # without reporting that first, when its object went.
    ends = (first("0", _engine_terminated),
            next((e.at for e in log.of("tp2-g0-r0") if e.type == "DELETED"), None))
    r0_ended = min((t for t in ends if t is not None), default=None)
    r1_asked = first("1", lambda p: p["metadata"].get("deletionTimestamp"))
    assert r0_ended is not None and r1_asked is not None, [(e.type, e.obj["metadata"]["name"])
                                                           for e in log.events]
    assert r1_asked >= r0_ended, \
        f"rank 1 was stopped {r0_ended - r1_asked:.1f}s before rank 0 ended"
    assert len(events(cluster, ns, "DrainStarted", "tp2")) == 1
    assert len(events(cluster, ns, "DrainFinished", "tp2")) == 1
