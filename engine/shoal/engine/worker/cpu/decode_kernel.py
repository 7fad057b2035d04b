"""The CPU paged-decode kernel (paged_decode.c): built on first use, loaded with ctypes.

Why a C file and not torch ops: with torch ops a decode row's K/V must first be gathered from its
blocks into a padded copy, then attended by SDPA, whose CPU kernel is built for long queries;
together they were about half of a decode step. The kernel reads K/V where they are, once.

Build: c_build.py (the machine's C compiler, -O3 -march=native -fopenmp, cached in
`$SHOAL_CACHE/kernels/`); the rows run on torch's own OpenMP threads (c_build says how).
No compiler, a failed build or `SHOAL_CPU_KERNEL=0`: `load()` returns None with the reason, and
attention stays on the torch path.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
from pathlib import Path

import torch
from shoal.engine.worker.cpu import c_build

log = logging.getLogger(__name__)

DISABLE_ENV = "SHOAL_CPU_KERNEL"
SOURCE = Path(__file__).with_name("paged_decode.c")

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


def build() -> Path:
    """The compiled paged_decode.c (c_build: cached by source, flags and CPU)."""
    return c_build.build(SOURCE)


class PagedDecodeKernel:
    """Callable wrapper: `kernel(q, k_cache, v_cache, table, ctx, scale, window, softcap,
    sinks)` -> out [R, Hq, D]. window (keys a row sees, None = all), softcap and sinks ([Hq]
    logits) are the attention variants transformers passes as sliding_window, softcap, s_aux.

    With several torch threads the rows are split into one contiguous range of about equal work
    per thread, at least MIN_ROWS_PER_THREAD rows each."""

    MIN_ROWS_PER_THREAD = 8

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.paged_decode
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = ([_PTR] * 6 + [_I64] * 7
                             + [ctypes.c_float, ctypes.c_float, _PTR, ctypes.c_int, ctypes.c_int])

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
        rc = self._fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(),
                      ctx.data_ptr(), out.data_ptr(), rows, num_heads, num_kv_heads, head_dim,
                      block_size, table.shape[1], window or 0, scale, softcap or 0.0, sinks_ptr,
                      int(q.dtype == torch.bfloat16),
                      c_build.threads(rows, self.MIN_ROWS_PER_THREAD))
        return out if rc == 0 else None


def load() -> tuple[PagedDecodeKernel | None, str]:
    """(kernel, how) or (None, why not)."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None, f"disabled by {DISABLE_ENV}=0"
    try:
        lib = c_build.load(SOURCE)
        return PagedDecodeKernel(lib), f"loaded {lib._name}"
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return None, str(exc)
