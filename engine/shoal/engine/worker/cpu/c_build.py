"""Build and load the engine's small C kernels (paged_decode.c, fused_ops.c).

Build: `$CC`, else cc / gcc / clang, with -O3 -march=native -fopenmp, into
`$SHOAL_CACHE/kernels/` (default ~/.cache/shoal/kernels) under a name that hashes the source with
the headers beside it (bf16.h), the flags and the CPU's feature flags, so a cache shared between
different CPUs stays correct. Plain C without torch headers: about a second each, once. Callers
fall back to torch ops, with the reason logged, when there is no compiler or the build or the
load fails.

Threads: the kernels split their rows with OpenMP, and must do it on torch's own OpenMP team.
torch's wheel ships libgomp.so.1 and loads it with torch; a library linked against libgomp.so.1
and loaded after torch is bound by the dynamic loader to that same copy (same soname), so the
kernels' threads are the very threads torch's ops run on. The Python thread pool this replaced
ran beside them: either both pools fought for the cores, or (with OMP_WAIT_POLICY=PASSIVE, what
the engine had to set) every torch op paid to wake its sleeping threads, 40-60 us per op on a
2-core VM. With one team, threads may spin between ops where the cores are the engine's own
(cpus.omp_wait_env; benchmarks/README.md, "One OpenMP team and vLLM's seats"). `load` checks
that only one OpenMP runtime is mapped and refuses the library otherwise.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

# Reassociation lets the compiler vectorise the sums and dot products; no -ffinite-math-only
# (the kernels keep every value finite, but the fallback-free contract is not worth a fast-math
# surprise). -Wno-psabi: on a CPU without AVX-512, GCC notes that a static helper passing a
# 64-byte vector has a different calling convention; those helpers never cross the library's
# boundary (only the exported functions, which take pointers, do), so the note is noise.
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
         "-fno-trapping-math", "-Wno-psabi", "-fopenmp", "-shared", "-fPIC"]


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


def compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def cache_dir() -> Path:
    root = os.environ.get("SHOAL_CACHE") or Path.home() / ".cache" / "shoal"
    return Path(root) / "kernels"


def build(source: Path) -> Path:
    """The compiled library of `source`, compiling it if this source/flags/CPU has none yet."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (set $CC, or install gcc)")
    # The headers beside the source (bf16.h) are part of what is compiled.
    text = b"".join(f.read_bytes() for f in [source, *sorted(source.parent.glob("*.h"))])
    key = hashlib.sha256(text + " ".join(FLAGS).encode() + cpu_flags().encode()).hexdigest()
    target = cache_dir() / f"{source.stem}-{key[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        proc = subprocess.run([cc, *FLAGS, "-o", str(out), str(source), "-lm"],
                              capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-500:]}")
        os.replace(out, target)  # atomic: concurrent engines never load a half-written file
    return target


def openmp_runtimes() -> list[str]:
    """The OpenMP runtimes mapped into this process (by file); [] where /proc is not readable."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    names = ("libgomp", "libiomp", "libomp")
    return sorted({line.split()[-1] for line in maps.splitlines()
                   if any(n in line.rsplit("/", 1)[-1] for n in names)})


def load(source: Path) -> ctypes.CDLL:
    """Build `source` if needed and load it, bound to torch's OpenMP runtime (torch is imported
    above, so its libgomp is loaded first). RuntimeError if the load brought a second runtime:
    two teams on the same cores would each slow the other, never silently."""
    before = openmp_runtimes()
    lib = ctypes.CDLL(str(build(source)))
    added = sorted(set(openmp_runtimes()) - set(before))
    if added and before:
        raise RuntimeError(f"{source.name} loaded a second OpenMP runtime ({', '.join(added)}) "
                           f"beside torch's ({', '.join(before)})")
    return lib


def threads(rows: int, min_rows_per_thread: int) -> int:
    """How many of torch's intra-op threads a kernel call over `rows` rows takes: all of them,
    as long as each gets at least `min_rows_per_thread` rows (below that a split costs more
    than it saves)."""
    return max(1, min(torch.get_num_threads(), rows // max(1, min_rows_per_thread)))
