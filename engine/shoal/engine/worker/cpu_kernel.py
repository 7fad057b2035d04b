"""The CPU paged-decode kernel (paged_decode.c): built on first use, loaded with ctypes.

Why a C file and not torch ops: with torch ops a decode row's K/V must first be gathered from its
blocks into a padded copy, then attended by SDPA, whose CPU kernel is built for long queries;
together they were about half of a decode step. The kernel reads K/V where they are, once.

Build: the machine's C compiler (`$CC`, else cc / gcc) with -O3 -march=native, into
`$SHOAL_CACHE/kernels/` (default ~/.cache/shoal/kernels) under a name that hashes the source, the
flags and the CPU's feature flags, so a cache shared between different CPUs stays correct. Plain C
without torch headers: about a second. No compiler, a failed build or `SHOAL_CPU_KERNEL=0`:
`load()` returns None with the reason, and attention stays on the torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

log = logging.getLogger(__name__)

DISABLE_ENV = "SHOAL_CPU_KERNEL"
SOURCE = Path(__file__).with_name("paged_decode.c")
# Reassociation lets the compiler vectorise the dot products; no -ffinite-math-only (the kernel
# keeps every value finite, but the fallback-free contract is not worth a fast-math surprise).
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
         "-fno-trapping-math", "-shared", "-fPIC"]

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
# The kernel's fixed buffers (MAXD, MAXBS, MAXG in paged_decode.c).
MAX_HEAD_DIM, MAX_BLOCK_SIZE, MAX_GROUP = 256, 64, 16


def fits(head_dim: int, block_size: int, num_heads: int, num_kv_heads: int) -> str | None:
    """None if the kernel handles this model and cache layout, else why not."""
    if num_heads % num_kv_heads:
        return f"{num_heads} query heads do not divide into {num_kv_heads} KV heads"
    if (head_dim > MAX_HEAD_DIM or block_size > MAX_BLOCK_SIZE
            or num_heads // num_kv_heads > MAX_GROUP):
        return (f"head_dim {head_dim} (max {MAX_HEAD_DIM}), block_size {block_size} (max "
                f"{MAX_BLOCK_SIZE}), {num_heads // num_kv_heads} query heads per KV head (max "
                f"{MAX_GROUP})")
    return None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _cache_dir() -> Path:
    root = os.environ.get("SHOAL_CACHE") or Path.home() / ".cache" / "shoal"
    return Path(root) / "kernels"


def build() -> Path:
    """The compiled library's path, compiling it if this source/flags/CPU has none yet."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (set $CC, or install gcc)")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(FLAGS).encode() + _cpu_flags().encode()).hexdigest()
    target = _cache_dir() / f"paged_decode-{key[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        proc = subprocess.run([cc, *FLAGS, "-o", str(out), str(SOURCE), "-lm"],
                              capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-500:]}")
        os.replace(out, target)  # atomic: concurrent engines never load a half-written file
    return target


class PagedDecodeKernel:
    """Callable wrapper: `kernel(q, k_cache, v_cache, table, ctx, scale, window, softcap,
    sinks)` -> out [R, Hq, D]. window (keys a row sees, None = all), softcap and sinks ([Hq]
    logits) are the attention variants transformers passes as sliding_window, softcap, s_aux.

    With several torch threads the rows are split into one contiguous range per thread, each
    range one call on a pool thread (ctypes releases the GIL during the call)."""

    MIN_ROWS_PER_THREAD = 8

    def __init__(self, path: Path) -> None:
        self._fn = ctypes.CDLL(str(path)).paged_decode
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = ([_PTR] * 6 + [_I64] * 7
                             + [ctypes.c_float, ctypes.c_float, _PTR, ctypes.c_int])
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 table: torch.Tensor, ctx: torch.Tensor, scale: float, window: int | None = None,
                 softcap: float | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor | None:
        """None where the shapes are outside what the kernel handles (use the torch path)."""
        rows, num_heads, head_dim = q.shape
        if sinks is not None:
            sinks = sinks.detach().to(torch.float32).contiguous()
        sinks_ptr = None if sinks is None else sinks.data_ptr()
        _, block_size, num_kv_heads, _ = k_cache.shape
        q = q.contiguous()
        out = torch.empty_like(q)
        width, elem = table.shape[1], q.element_size()

        def run(start: int, end: int) -> int:
            row_bytes = num_heads * head_dim * elem
            return self._fn(q.data_ptr() + start * row_bytes, k_cache.data_ptr(),
                            v_cache.data_ptr(), table.data_ptr() + start * width * 8,
                            ctx.data_ptr() + start * 8, out.data_ptr() + start * row_bytes,
                            end - start, num_heads, num_kv_heads, head_dim, block_size, width,
                            window or 0, scale, softcap or 0.0, sinks_ptr,
                            int(q.dtype == torch.bfloat16))

        threads = min(torch.get_num_threads(), rows // self.MIN_ROWS_PER_THREAD)
        if threads <= 1:
            rc = run(0, rows)
        else:
            if self._pool_size < threads:
                if self._pool is not None:
                    self._pool.shutdown(wait=False)
                self._pool = ThreadPoolExecutor(threads, thread_name_prefix="paged-decode")
                self._pool_size = threads
            bounds = [rows * i // threads for i in range(threads + 1)]
            rc = min(self._pool.map(run, bounds[:-1], bounds[1:]))
        return out if rc == 0 else None


def load() -> tuple[PagedDecodeKernel | None, str]:
    """(kernel, how) or (None, why not)."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None, f"disabled by {DISABLE_ENV}=0"
    try:
        path = build()
        return PagedDecodeKernel(path), f"loaded {path}"
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return None, str(exc)
