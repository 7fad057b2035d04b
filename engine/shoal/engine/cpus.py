"""The CPUs this process may use, and the torch threads an engine rank takes by default.

Why: `os.cpu_count()` (and torch's default of one thread per core) counts the node's cores; in
a Kubernetes pod the cpuset and the CPU limit (a cgroup quota) bound what the engine really
gets, and more threads than that only wait on each other. A `shoal serve` API server also shares
its machine with the engine it serves: measured on a 2-core AVX-512 EPYC (2026-12-01, tiny
model, 200 x 128/128 requests, bf16), the engine on one thread served 8,099-9,664 output tok/s
at ITL p50 15.9-17.2 ms, on two 7,683-8,492 tok/s at 18.8-21.0 ms: the second thread kept
stopping for the API server, and every parallel op waits for its slowest thread. vLLM's CPU
backend likewise leaves a core to its API server. Torch-free (the operator's tests import the
CLI).
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


def engine_threads(local_ranks: int, api_server_here: bool, cpus: int | None = None) -> int:
    """Torch threads per engine rank: the usable CPUs, less one for a co-located API server
    (when there are at least two), split over this node's ranks; at least one."""
    cpus = usable_cpus() if cpus is None else cpus
    if api_server_here and cpus > 1:
        cpus -= 1
    return max(1, cpus // max(1, local_ranks))
