"""cpus.py: the CPUs a process may use (affinity, cgroup v2 and v1 CPU limits) and the torch
threads an engine rank takes by default."""

from __future__ import annotations

import os

import pytest
from shoal.engine.worker.cpu import cpus

AFFINITY = len(os.sched_getaffinity(0))


@pytest.mark.parametrize("files, want", [
    ({}, AFFINITY),  # no cgroup files: the affinity mask
    ({"cpu.max": "max 100000\n"}, AFFINITY),  # v2, no limit
    ({"cpu.max": "50000 100000\n"}, 1),  # half a CPU: one thread
    ({"cpu.max": "150000 100000\n"}, min(AFFINITY, 2)),  # 1.5 CPUs: rounded up
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, AFFINITY),  # v1
    ({"cpu/cpu.cfs_quota_us": "100000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1),
])
def test_usable_cpus_takes_the_cgroup_limit(tmp_path, files, want):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cpus.usable_cpus(tmp_path) == want


@pytest.mark.parametrize("ranks, n, want", [(1, 2, 2), (1, 1, 1), (2, 9, 4), (4, 2, 1)])
def test_engine_threads_split_the_usable_cpus_over_the_ranks(ranks, n, want):
    assert cpus.engine_threads(ranks, cpus=n) == want


def test_idle_openmp_threads_sleep_unless_the_process_has_cpus_of_its_own(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    env, why = cpus.omp_wait_env({})
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"} and "may share its cores" in why
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2, 3})  # a cpuset of its own
    env, why = cpus.omp_wait_env({})
    assert env == {} and "pinned to 2 of 4 CPUs" in why
    # Whoever set a policy or a spin count decided: nothing is added.
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert cpus.omp_wait_env({"GOMP_SPINCOUNT": "300000"}) == (
        {}, "idle OpenMP threads as the environment says (GOMP_SPINCOUNT=300000)")
    assert cpus.omp_wait_env({"OMP_WAIT_POLICY": "ACTIVE"})[0] == {}
