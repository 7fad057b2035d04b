"""The CPU KV cache's memory: zero views of one mapping, committed in the background without
disturbing what steps write meanwhile, or zeroed up front where the kernel cannot populate."""

from __future__ import annotations

import sys

import pytest
import torch
from shoal.engine.worker import kv_memory
from shoal.engine.worker.kv_memory import KvArena

MIB = 1 << 20


def _resident_bytes(t: torch.Tensor) -> int:
    """Rss of the mapping that holds t, from /proc/self/smaps."""
    addr, rss, inside = t.data_ptr(), 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("Rss:"):
                rss = int(line.split()[1]) * 1024
    return rss


def test_views_are_zero_disjoint_and_bounded():
    arena = KvArena(6 * MIB)
    a = arena.tensor((16, 16, 2, 64), torch.float32)  # 128 KiB
    b = arena.tensor((16, 16, 2, 64), torch.bfloat16)
    assert a.is_contiguous() and a.dtype == torch.float32 and not a.any() and not b.any()
    a.fill_(1.0)
    assert not b.any()
    assert b.data_ptr() == a.data_ptr() + a.numel() * 4
    with pytest.raises(ValueError, match="cannot hold"):
        arena.tensor((6 * MIB,), torch.uint8)


@pytest.mark.skipif(sys.platform != "linux", reason="/proc/self/smaps")
def test_commit_makes_every_page_resident_and_keeps_what_was_written_meanwhile():
    arena = KvArena(512 * MIB)
    k = arena.tensor((512 * MIB // 4,), torch.float32)
    arena.commit()
    k[::4096].fill_(3.0)  # a step's writes, racing the background commit: one per 16 KiB
    k[-1] = 7.0
    assert arena.committed.wait(60), "the background commit never finished"
    assert "committed in the background" in arena.how, arena.how
    assert bool((k[::4096] == 3.0).all()) and float(k[-1]) == 7.0
    assert float(k[1:4096].abs().sum()) == 0.0  # and nothing else was written
    assert _resident_bytes(k) >= 512 * MIB


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice")
def test_the_background_commit_runs_at_the_lowest_priority_on_its_own_thread(monkeypatch):
    import os
    import threading

    calls = []
    real = os.setpriority

    def record(which, who, prio):
        calls.append((which, who, prio, threading.current_thread().name,
                      threading.get_native_id()))
        real(which, who, prio)

    monkeypatch.setattr(os, "setpriority", record)
    before = os.getpriority(os.PRIO_PROCESS, 0)
    arena = KvArena(64 * MIB)
    arena.tensor((64 * MIB,), torch.uint8)
    arena.commit()
    assert arena.committed.wait(60)
    if "background" not in arena.how:
        pytest.skip(f"this kernel cannot populate in the background: {arena.how}")
    (which, who, prio, name, tid), = calls
    assert (which, prio, name) == (os.PRIO_PROCESS, 19, "kv-commit-0")
    assert who == tid != threading.get_native_id()  # that thread only, not the engine's
    assert os.getpriority(os.PRIO_PROCESS, 0) == before


def test_without_madvise_the_memory_is_zeroed_before_start_up_returns(monkeypatch, caplog):
    monkeypatch.setattr(kv_memory, "_libc", lambda: None)
    caplog.set_level("INFO")
    arena = KvArena(8 * MIB, rank=3)
    t = arena.tensor((2 * MIB,), torch.float32)
    arena.commit()
    assert arena.committed.is_set() and "no madvise" in arena.how
    assert "rank 3: KV cache memory (0.01 GiB) zeroed before start-up" in caplog.text
    assert not t.any()


def test_the_engine_keeps_its_cpu_cache_in_an_arena(make_llm, tiny_model):
    llm = make_llm(tiny_model, dtype="float32", max_model_len=256)
    runner = llm.engine_core.model_executor.worker.model_runner
    assert runner.kv_arena.committed.wait(60)
    k0, v0 = runner.kv_caches[0]
    assert k0.data_ptr() == runner.kv_arena._bytes.data_ptr()
    assert runner.kv_arena.nbytes == k0.shape[0] * runner.kv_bytes_per_block()
    assert v0.data_ptr() == k0.data_ptr() + k0.numel() * k0.element_size()
