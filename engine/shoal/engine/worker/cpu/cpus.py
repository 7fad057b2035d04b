"""The CPUs this process may use, and the torch threads an engine rank takes by default.

Why: `os.cpu_count()` (and torch's default of one thread per core) counts the node's cores; in
a Kubernetes pod the cpuset and the CPU limit (a cgroup quota) bound what the engine really
gets, and more threads than that only wait on each other.

The API server beside an engine gets no core of its own: measured on a 2-core AVX-512 EPYC
(2026-12-01, 200 x 128/128 requests, bf16, the second load of each start), one engine thread
served the tiny model 3-26% faster than two (8,744-9,664 against 7,683-8,492 output tok/s: its
small ops kept waiting for the thread the API server interrupted), but the small model 31%
slower (876 against 1,273), and a compute-bound model is what a CPU engine is sized for.

OpenMP's wait policy (`omp_wait_env`): the kernels and torch's ops share one OpenMP team
(worker/cpu/c_build.py), whose idle threads by libgomp's default spin a while between ops. On cores
of its own that is worth 11-12% served (an idle op's wake-up costs 40-60 us here), but two engines
spinning on shared cores starve each other: two `shoal serve` on 2 cores, two streams of 1,000
tokens each, finished in 20.8 s spinning against 3.6 s with sleeping threads (10,000 spins:
20.2 s; 1,000: 5.2 s). So threads sleep (`OMP_WAIT_POLICY=PASSIVE`) unless this process is
pinned to CPUs of its own (an affinity mask narrower than the machine: Kubernetes' static CPU
manager for a Guaranteed pod with whole CPUs, or `taskset`), or the environment already sets
`OMP_WAIT_POLICY` or `GOMP_SPINCOUNT` (benchmarks/README.md, "One OpenMP team and vLLM's
seats"). Torch-free.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


def _quota(root: Path) -> float | None:
    """The cgroup's CPU limit in CPUs (v2 `cpu.max`, else v1 `cpu.cfs_quota_us`), or None."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def usable_cpus(cgroup: Path = CGROUP) -> int:
    """CPUs in this process's affinity mask, capped by its cgroup's CPU limit (rounded up)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    limit = _quota(cgroup)
    if limit is not None:
        cpus = min(cpus, max(1, math.ceil(limit)))
    return max(1, cpus)


def engine_threads(local_ranks: int, cpus: int | None = None) -> int:
    """Torch threads per engine rank: the usable CPUs split over this node's ranks; at least
    one."""
    cpus = usable_cpus() if cpus is None else cpus
    return max(1, cpus // max(1, local_ranks))


WAIT_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def pinned() -> tuple[int, int] | None:
    """(CPUs in this process's affinity mask, CPUs online) when the mask is the narrower; None
    when it spans the machine (or the platform has no affinity)."""
    try:
        mine = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return None
    online = os.cpu_count() or mine
    return (mine, online) if mine < online else None


def omp_wait_env(environ: dict[str, str] | None = None) -> tuple[dict[str, str], str]:
    """The OpenMP variables an engine process starts with (before torch loads OpenMP), and a line
    for the log saying why (the module docstring has the measurements)."""
    environ = os.environ if environ is None else environ
    given = [f"{k}={environ[k]}" for k in WAIT_ENV if k in environ]
    if given:
        return {}, f"idle OpenMP threads as the environment says ({', '.join(given)})"
    own = pinned()
    if own is not None:
        return {}, (f"idle OpenMP threads spin briefly (libgomp's default): this process is "
                    f"pinned to {own[0]} of {own[1]} CPUs")
    return {"OMP_WAIT_POLICY": "PASSIVE"}, (
        "idle OpenMP threads sleep (OMP_WAIT_POLICY=PASSIVE): this process may run on any CPU, "
        "so another process may share its cores (pin it, or set GOMP_SPINCOUNT, to spin)")
