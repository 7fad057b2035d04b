"""The CPU paged-decode kernel: built with the machine's compiler, equal to plain attention over
the gathered context, and an engine that cannot build it falls back to the torch path."""

from __future__ import annotations

import shutil

import pytest
import torch
from shoal.engine import wire
from shoal.engine.worker.cpu import c_build
from shoal.engine.worker.cpu import decode_kernel as cpu_kernel

pytestmark = pytest.mark.skipif(c_build.compiler() is None, reason="no C compiler here")


@pytest.fixture(scope="module")
def kernel():
    k, how = cpu_kernel.load()
    assert k is not None, how
    return k


def reference(q, k_cache, v_cache, table, ctx, scale, window=None, softcap=None, sinks=None):
    """Attention per row over its first ctx tokens (the last `window` of them), in float64, as
    transformers' eager functions compute it: scores soft-capped, a sink logit per head in the
    softmax's denominator."""
    _, bs, hkv, d = k_cache.shape
    group = q.shape[1] // hkv
    out = torch.empty(q.shape, dtype=torch.float64)
    for r in range(q.shape[0]):
        n = int(ctx[r])
        first = max(0, n - window) if window else 0
        blocks = table[r, : -(-n // bs)]
        k = k_cache[blocks].reshape(-1, hkv, d)[first:n].double()  # [n, Hkv, D]
        v = v_cache[blocks].reshape(-1, hkv, d)[first:n].double()
        for h in range(q.shape[1]):
            s = (k[:, h // group] @ q[r, h].double()) * scale
            if softcap:
                s = torch.tanh(s / softcap) * softcap
            if sinks is not None:
                s = torch.cat([s, sinks[h:h + 1].double()])
            p = s.softmax(0)[: k.shape[0]]
            out[r, h] = p @ v[:, h // group]
    return out


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
# Up to 64 query heads the kernel walks every KV head of a block together (its query heads per
# KV head: 1, 2 and 4 compiled for, 3 not); 72 takes its per-head path.
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (4, 2), (12, 4), (72, 8), (48, 16)])
# 64: bf16 read as pairs; 48 (a multiple of 16, not of 32): bf16 widened sixteen at a time; 40:
# not a multiple of 16, the per-head path.
@pytest.mark.parametrize("d", [64, 48, 40])
def test_kernel_equals_attention_over_the_gathered_context(kernel, dtype, tol, num_heads,
                                                           num_kv_heads, d):
    gen = torch.Generator().manual_seed(0)
    num_blocks, bs = 64, 16
    k_cache = torch.randn(num_blocks, bs, num_kv_heads, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, bs, num_kv_heads, d, generator=gen).to(dtype)
    ctx = torch.tensor([1, 15, 16, 17, 100, 160])  # in a block, at and across block edges
    width = 10
    # Each row owns scattered blocks (not contiguous, not in order); the padding is never read.
    table = torch.randperm(num_blocks - 1, generator=gen)[: len(ctx) * width].add(1)
    table = table.reshape(len(ctx), width).contiguous()
    q = torch.randn(len(ctx), num_heads, d, generator=gen).to(dtype)
    scale = d ** -0.5
    out = kernel(q, k_cache, v_cache, table, ctx, scale)
    assert out.dtype == dtype and out.shape == q.shape
    ref = reference(q, k_cache, v_cache, table, ctx, scale)
    assert (out.double() - ref).abs().max().item() < tol


@pytest.mark.parametrize("window, softcap, with_sinks", [
    (20, None, False), (16, None, False), (1, None, False), (None, 1.5, False),
    (None, None, True), (20, 1.5, True)])
@pytest.mark.parametrize("num_kv_heads, group", [(2, 2), (8, 9)])  # both of the kernel's paths
def test_kernel_implements_windows_softcap_and_sinks(kernel, window, softcap, with_sinks,
                                                     num_kv_heads, group):
    """Sliding windows (across, at and inside block edges, and a window of one), Gemma-2's
    soft-capping and gpt-oss's sinks, each equal to transformers' eager semantics; every case
    also differs from plain attention, so a kernel that ignored the argument would fail."""
    gen = torch.Generator().manual_seed(3)
    num_blocks, bs, d = 128, 16, 64
    k_cache = torch.randn(num_blocks, bs, num_kv_heads, d, generator=gen)
    v_cache = torch.randn(num_blocks, bs, num_kv_heads, d, generator=gen)
    ctx = torch.tensor([1, 15, 16, 17, 33, 100, 160])
    table = torch.randperm(num_blocks - 1, generator=gen)[: len(ctx) * 10].add(1)
    table = table.reshape(len(ctx), 10).contiguous()
    num_heads = num_kv_heads * group
    # scores of a few units: the cap bites
    q = 2 * torch.randn(len(ctx), num_heads, d, generator=gen)
    sinks = torch.randn(num_heads, generator=gen) + 1.0 if with_sinks else None
    scale = d ** -0.5
    out = kernel(q, k_cache, v_cache, table, ctx, scale, window, softcap, sinks)
    ref = reference(q, k_cache, v_cache, table, ctx, scale, window, softcap, sinks)
    assert (out.double() - ref).abs().max().item() < 1e-5
    plain = reference(q, k_cache, v_cache, table, ctx, scale)
    assert (out.double() - plain).abs().max().item() > 1e-2


def test_no_rows_is_an_empty_answer(kernel):
    cache = torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16)
    out = kernel(torch.zeros(0, 4, 64, dtype=torch.bfloat16), cache, cache,
                 torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, dtype=torch.long), 0.125)
    assert out is not None and out.shape == (0, 4, 64)


def test_rows_split_across_threads_give_the_same_bits(kernel):
    gen = torch.Generator().manual_seed(1)
    k_cache = torch.randn(128, 16, 2, 64, generator=gen).bfloat16()
    v_cache = torch.randn(128, 16, 2, 64, generator=gen).bfloat16()
    rows = 41  # not a multiple of the thread count
    table = torch.randint(1, 128, (rows, 8), generator=gen)
    ctx = torch.randint(1, 128, (rows,), generator=gen)
    q = torch.randn(rows, 4, 64, generator=gen).bfloat16()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(q, k_cache, v_cache, table, ctx, 0.125)
        torch.set_num_threads(3)
        split = kernel(q, k_cache, v_cache, table, ctx, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, split)


def test_kernel_refuses_shapes_outside_its_limits(kernel):
    q = torch.zeros(1, 4, 512)  # head_dim above the kernel's 256
    cache = torch.zeros(2, 16, 4, 512)
    assert kernel(q, cache, cache, torch.zeros(1, 1, dtype=torch.long),
                  torch.ones(1, dtype=torch.long), 1.0) is None


def test_fits_names_the_limit_a_model_is_outside_of():
    assert cpu_kernel.fits(64, 16, 12, 4) is None
    assert "head_dim 512" in cpu_kernel.fits(512, 16, 4, 4)
    assert "do not divide" in cpu_kernel.fits(64, 16, 6, 4)


@pytest.mark.process  # runs the C compiler
def test_build_is_cached_by_source_flags_and_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("SHOAL_CACHE", str(tmp_path))
    first = cpu_kernel.build()
    assert first.parent == tmp_path / "kernels"
    mtime = first.stat().st_mtime_ns
    assert cpu_kernel.build() == first and first.stat().st_mtime_ns == mtime  # not rebuilt


@pytest.mark.process  # runs the C compiler
def test_a_changed_header_rebuilds_the_library(tmp_path, monkeypatch):
    import shutil as sh

    monkeypatch.setenv("SHOAL_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "src"
    src.mkdir()
    source = sh.copy(cpu_kernel.SOURCE, src / cpu_kernel.SOURCE.name)
    header = sh.copy(cpu_kernel.SOURCE.with_name("bf16.h"), src / "bf16.h")
    first = c_build.build(source)
    with open(header, "a") as f:
        f.write("// changed\n")
    assert c_build.build(source) != first


def test_without_a_compiler_the_engine_says_why_and_uses_the_torch_path(
        make_llm, tiny_model, tmp_path, monkeypatch, caplog):
    params = wire.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 6, 7], list(range(100, 140))]
    with_kernel = make_llm(tiny_model, dtype="float32", max_model_len=256)
    runner = with_kernel.engine_core.model_executor.worker.model_runner
    assert runner.cpu.decode_kernel is not None
    expected = [o.outputs[0].token_ids for o in with_kernel.generate(prompts, params)]

    monkeypatch.setenv("SHOAL_CACHE", str(tmp_path))  # nothing built here yet
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setattr(shutil, "which", lambda name: None)
    caplog.set_level("WARNING")
    fallback = make_llm(tiny_model, dtype="float32", max_model_len=256)
    assert fallback.engine_core.model_executor.worker.model_runner.cpu.decode_kernel is None
    assert "no C compiler" in caplog.text
    assert [o.outputs[0].token_ids for o in fallback.generate(prompts, params)] == expected


def test_the_kernel_can_be_switched_off(monkeypatch):
    monkeypatch.setenv(cpu_kernel.DISABLE_ENV, "0")
    kernel, why = cpu_kernel.load()
    assert kernel is None and cpu_kernel.DISABLE_ENV in why


@pytest.mark.process  # runs the C compiler
def test_the_c_sources_compile_without_a_warning_at_the_shipped_flags(tmp_path):
    """c_build keeps a successful compiler's stderr to itself: a warning (a flag GCC drops, a
    vector extension it splits) would otherwise go unseen."""
    import subprocess

    from shoal.engine.worker.cpu import fused as cpu_fused

    for source in (cpu_kernel.SOURCE, cpu_fused.SOURCE):
        flags = [f for f in c_build.FLAGS if f != "-shared"]
        proc = subprocess.run([c_build.compiler(), *flags, "-Wall", "-Werror", "-c", "-o",
                               str(tmp_path / "x.o"), str(source)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr


def test_the_kernels_run_on_torchs_own_openmp_runtime(kernel):
    """Both libraries are linked against libgomp.so.1; loaded after torch they must bind to
    torch's copy (one team of threads), not bring the system's in beside it (torch's wheel
    ships its own in torch/lib, so a second binding would show as a second file)."""
    from shoal.engine.worker.cpu import fused as cpu_fused

    assert cpu_fused.load()[0] is not None
    assert len(c_build.openmp_runtimes()) == 1, c_build.openmp_runtimes()


def test_a_library_that_brings_a_second_openmp_runtime_is_refused(monkeypatch):
    seen = iter([["/torch/lib/libgomp.so.1"],
                 ["/torch/lib/libgomp.so.1", "/usr/lib/libgomp.so.1"]])
    monkeypatch.setattr(c_build, "openmp_runtimes", lambda: next(seen))
    with pytest.raises(RuntimeError, match=r"second OpenMP runtime \(/usr/lib/libgomp.so.1\)"):
        c_build.load(cpu_kernel.SOURCE)
