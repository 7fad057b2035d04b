"""Build the engine's small C kernels (paged_decode.c, fused_ops.c) with the machine's compiler.

`$CC`, else cc / gcc / clang, with -O3 -march=native, into `$SHOAL_CACHE/kernels/` (default
~/.cache/shoal/kernels) under a name that hashes the source, the flags and the CPU's feature
flags, so a cache shared between different CPUs stays correct. Plain C without torch headers:
about a second each, once. Callers load the result with ctypes and fall back to torch ops, with
the reason logged, when there is no compiler or the build fails.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

# Reassociation lets the compiler vectorise the sums and dot products; no -ffinite-math-only
# (the kernels keep every value finite, but the fallback-free contract is not worth a fast-math
# surprise).
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
         "-fno-trapping-math", "-shared", "-fPIC"]


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
    text = source.read_bytes()
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
