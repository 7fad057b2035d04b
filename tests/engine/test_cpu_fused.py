"""cpu_fused.py: fused RMSNorm, SiLU-gated MLP and RoPE equal transformers' own modules and
functions, are swapped in only where a probe agrees, and never change a forward outside Shoal's.
"""

from __future__ import annotations

import logging

import pytest
import torch
from shoal.engine import wire
from shoal.engine.worker.cpu import c_build
from shoal.engine.worker.cpu import fused as cpu_fused
from torch import nn
from transformers import LlamaConfig
from transformers.models.gemma2 import modeling_gemma2
from transformers.models.gpt_oss import modeling_gpt_oss
from transformers.models.llama import modeling_llama

pytestmark = pytest.mark.skipif(c_build.compiler() is None, reason="no C compiler here")

GEN = torch.Generator().manual_seed(0)


@pytest.fixture(scope="module")
def ops():
    ops, why = cpu_fused.load()
    assert ops is not None, why
    return ops


def randn(*shape):
    return torch.randn(*shape, generator=GEN)


def llama_norm(width: int) -> nn.Module:
    norm = modeling_llama.LlamaRMSNorm(width, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(randn(width))
    return norm


@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_rms_norm_equals_llamas_and_gemmas(ops, tokens):
    norm = llama_norm(96)
    x = randn(1, tokens, 96)
    fused = cpu_fused.FusedRMSNorm(norm, ops, 0.0, norm.variance_epsilon)
    torch.testing.assert_close(fused(x), norm(x), rtol=1e-5, atol=1e-6)
    gemma = modeling_gemma2.Gemma2RMSNorm(96, eps=1e-6)
    with torch.no_grad():
        gemma.weight.copy_(randn(96))
    fused = cpu_fused.FusedRMSNorm(gemma, ops, 1.0, gemma.eps)  # (1 + w) * x_hat
    torch.testing.assert_close(fused(x), gemma(x), rtol=1e-5, atol=1e-6)


def test_rms_norm_reads_strided_rows_and_hands_other_inputs_to_the_original(ops):
    norm = llama_norm(32)
    fused = cpu_fused.FusedRMSNorm(norm, ops, 0.0, norm.variance_epsilon)
    wide = randn(1, 9, 4, 32)[:, :, 1]  # rows 128 floats apart, as a head-wise slice would be
    assert not wide.is_contiguous()
    torch.testing.assert_close(fused(wide), norm(wide), rtol=1e-5, atol=1e-6)
    bf16 = randn(1, 5, 32).bfloat16()
    assert torch.equal(fused(bf16), norm(bf16))  # not the kernel's dtype: the original forward
    columns = randn(1, 32, 5).transpose(1, 2)  # hidden not unit-stride
    assert torch.equal(fused(columns), norm(columns))


def test_a_row_does_not_depend_on_the_thread_split(ops):
    norm = llama_norm(64)
    fused = cpu_fused.FusedRMSNorm(norm, ops, 0.0, norm.variance_epsilon)
    x = randn(1, 2001, 64)  # enough rows to split, not a multiple of the thread count
    q, k = randn(1, 2001, 4 * 16).view(1, 2001, 4, 16).transpose(1, 2), randn(1, 2, 2001, 16)
    cos, sin = randn(1, 2001, 16), randn(1, 2001, 16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fused(x), ops.rope(q, k, cos, sin)
        torch.set_num_threads(3)
        split = fused(x), ops.rope(q, k, cos, sin)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one[0], split[0])
    assert all(torch.equal(a, b) for a, b in zip(one[1], split[1], strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_is_torchs_first_maximum_with_ties_nans_and_strided_rows(ops, dtype):
    # Rows 8200 apart, 8192 read (a view, as a logits slice); enough rows for three threads.
    wide = randn(803, 8200).to(dtype)
    assert 803 * 8192 >= 3 * cpu_fused.ARGMAX_MIN_FLOATS_PER_THREAD
    logits = wide[:, :8192]
    logits[0] = 1.0  # all tied: the first
    logits[1, 5000] = logits[1, 7000] = 1e4  # tied maximum: the first of the two
    logits[2] = float("-inf")
    logits[3, 9] = float("nan")  # a NaN is the maximum, as in torch
    logits[3, 100] = 1e4
    logits[4, 8191] = 1e4  # the last element
    logits[5] = -1.0
    logits[5, 10], logits[5, 20] = -0.0, 0.0  # -0 equals +0: the first of them
    logits[6, 50] = -float("nan")  # a NaN with its sign bit set is the maximum too
    logits[7, 300:] = -1e4
    logits[7, 600] = 1e3  # the maximum in a later chunk than the first's best
    want = logits.max(dim=-1).indices
    before = torch.get_num_threads()
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            assert torch.equal(ops.argmax(logits), want)
    finally:
        torch.set_num_threads(before)
    assert ops.argmax(logits.t()) is None  # not unit stride along the vocabulary
    assert ops.argmax(logits[None]) is None


def test_greedy_sampling_takes_the_kernel_and_agrees_with_torch(ops):
    from shoal.engine.worker import sampler

    logits = randn(64, 1000).bfloat16()
    meta = sampler.SamplingMetadata(temperature=torch.ones(64), greedy=torch.ones(64, dtype=bool),
                                    all_greedy=True, top_k=None, top_p=None, min_p=None,
                                    generators={})
    calls = []

    def counted(x):
        calls.append(x.shape)
        return ops.argmax(x)

    assert torch.equal(sampler.sample(logits, meta, argmax=counted),
                       sampler.sample(logits, meta))
    assert calls == [(64, 1000)]


@pytest.mark.parametrize("rot_dim", [16, 8])  # full rotation, and a partial one (Phi-3 style)
def test_rope_equals_rotate_half_with_the_layout_transformers_hands_over(ops, rot_dim):
    from transformers.models.phi3 import modeling_phi3

    tokens, heads, kv_heads, head_dim = 11, 4, 2, 16
    # As the attention layers make them: projection output viewed [1, T, H, D], transposed.
    q = randn(1, tokens, heads * head_dim).view(1, tokens, heads, head_dim).transpose(1, 2)
    k = randn(1, tokens, kv_heads * head_dim).view(1, tokens, kv_heads, head_dim).transpose(1, 2)
    cos, sin = randn(1, tokens, rot_dim), randn(1, tokens, rot_dim)
    reference = (modeling_llama.apply_rotary_pos_emb if rot_dim == head_dim
                 else modeling_phi3.apply_rotary_pos_emb)
    want = reference(q, k, cos, sin)
    got = ops.rope(q, k, cos, sin)
    for w, g in zip(want, got, strict=True):
        assert g.shape == w.shape
        if rot_dim == head_dim:  # torch's elementwise output keeps the input's layout; so do we
            assert g.stride() == w.stride()
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    # Mixed dtypes (bf16 q/k, float32 cos/sin) promote in torch: the caller runs the original.
    assert ops.rope(q.bfloat16(), k.bfloat16(), cos, sin) is None


@pytest.mark.parametrize("rot_dim", [16, 8])
def test_bf16_rope_gives_torchs_bits(ops, rot_dim):
    """In bf16 each product and the sum are rounded where torch's bf16 ops round them."""
    from transformers.models.phi3 import modeling_phi3

    tokens, head_dim = 301, 16
    q = randn(1, tokens, 4 * head_dim).bfloat16().view(1, tokens, 4, head_dim).transpose(1, 2)
    k = randn(1, tokens, 2 * head_dim).bfloat16().view(1, tokens, 2, head_dim).transpose(1, 2)
    cos, sin = randn(1, tokens, rot_dim).bfloat16(), randn(1, tokens, rot_dim).bfloat16()
    reference = (modeling_llama.apply_rotary_pos_emb if rot_dim == head_dim
                 else modeling_phi3.apply_rotary_pos_emb)
    for w, g in zip(reference(q, k, cos, sin), ops.rope(q, k, cos, sin), strict=True):
        assert g.dtype == torch.bfloat16 and torch.equal(g, w)


def _bf16_norm(cls, width=256):
    norm = cls(width, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(randn(width))
    return norm.bfloat16()


@pytest.mark.parametrize("name, offset, twice", [
    ("llama", 0.0, True),  # w * x_hat.to(bf16): two roundings
    ("gemma2", 1.0, False),  # ((1 + w.float()) * x_hat).type_as(x): one
    ("olmo2", 0.0, False)])  # (w * x_hat).to(bf16): one
def test_bf16_norms_take_the_rounding_their_model_uses(name, offset, twice):
    from transformers.models.olmo2 import modeling_olmo2

    cls = {"llama": modeling_llama.LlamaRMSNorm, "gemma2": modeling_gemma2.Gemma2RMSNorm,
           "olmo2": modeling_olmo2.Olmo2RMSNorm}[name]
    model = nn.ModuleDict({"norm": _bf16_norm(cls)})
    orig = model["norm"]
    fused = cpu_fused.fuse(model)
    got = model["norm"]
    assert fused.norms == 1 and (got.w_offset, got.round_twice) == (offset, twice)
    x = (3 * randn(1, 2000, 256)).bfloat16()
    want, out = orig(x), got(x)
    assert cpu_fused.same_values(out, want)
    assert (out == want).float().mean().item() > 0.999  # torch's bits, but for rare elements
    other = cpu_fused.FusedRMSNorm(orig, got.ops, offset, got.eps, not twice)(x)
    assert not cpu_fused.same_values(other, want)  # rounding elsewhere is told apart


def test_bf16_mlp_in_place_is_the_original():
    cfg = LlamaConfig(hidden_size=32, intermediate_size=48, hidden_act="silu")
    model = nn.ModuleDict({"mlp": modeling_llama.LlamaMLP(cfg).bfloat16()})
    x = randn(1, 6, 32).bfloat16()
    want = model["mlp"](x)
    assert cpu_fused.fuse(model).mlps == 1
    assert torch.equal(model["mlp"](x), want)


def test_mlp_in_place_equals_the_original_and_only_silu_gated_mlps_are_taken():
    cfg = LlamaConfig(hidden_size=32, intermediate_size=48, hidden_act="silu")
    mlp = modeling_llama.LlamaMLP(cfg)
    x = randn(1, 6, 32)
    assert torch.equal(cpu_fused.FusedSiluMLP(mlp)(x), mlp(x))
    assert cpu_fused._is_silu_mlp(mlp)
    assert not cpu_fused._is_silu_mlp(modeling_llama.LlamaMLP(
        LlamaConfig(hidden_size=32, intermediate_size=48, hidden_act="gelu")))


class OddRMSNorm(nn.Module):
    """Named like an RMSNorm, computes something else (mean absolute value)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = 1e-6

    def forward(self, x):
        return self.weight * x / (x.abs().mean(-1, keepdim=True) + self.eps)


def test_fuse_swaps_only_what_its_probe_agrees_with_and_says_what_it_kept():
    cfg = LlamaConfig(hidden_size=32, intermediate_size=48)
    model = nn.ModuleDict({"norm": llama_norm(32), "odd": OddRMSNorm(32),
                           "mlp": modeling_llama.LlamaMLP(cfg)})
    x = randn(1, 4, 32)
    odd_before = model["odd"](x)
    fused = cpu_fused.fuse(model)
    assert (fused.norms, fused.mlps) == (1, 1)
    assert isinstance(model["norm"], cpu_fused.FusedRMSNorm)
    assert isinstance(model["mlp"], cpu_fused.FusedSiluMLP)
    assert type(model["odd"]) is OddRMSNorm and torch.equal(model["odd"](x), odd_before)
    assert "kept as they are (the probe disagreed): OddRMSNorm" in fused.how
    # The fused norm shares the original's weight: no second copy, the same state_dict keys.
    assert list(model.state_dict()) == ["norm.weight", "odd.weight", "mlp.gate_proj.weight",
                                        "mlp.up_proj.weight", "mlp.down_proj.weight"]


def test_the_switch_keeps_every_module(monkeypatch):
    monkeypatch.setenv(cpu_fused.DISABLE_ENV, "0")
    model = nn.ModuleDict({"norm": llama_norm(32)})
    fused = cpu_fused.fuse(model)
    assert fused.ops is None and fused.rope == [] and cpu_fused.DISABLE_ENV in fused.how
    assert type(model["norm"]) is modeling_llama.LlamaRMSNorm


def _rope_args(head_dim: int, rot_dim: int):
    q = randn(1, 5, 2 * head_dim).view(1, 5, 2, head_dim).transpose(1, 2)
    k = randn(1, 5, 2 * head_dim).view(1, 5, 2, head_dim).transpose(1, 2)
    return q, k, randn(1, 5, rot_dim), randn(1, 5, rot_dim)


def test_rope_dispatch_is_the_original_outside_a_shoal_forward(ops):
    calls = []

    def original(q, k, cos, sin, unsqueeze_dim=1):
        calls.append(1)
        return modeling_llama.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)

    dispatch = cpu_fused.RopeDispatch(original, "test")
    args = _rope_args(16, 16)
    dispatch(*args)
    assert calls == [1] and dispatch.agrees is None  # no active ops: untouched, unchecked
    with cpu_fused.active(ops):
        first = dispatch(*args)  # checked against the original, whose result is returned
        assert calls == [1, 1] and dispatch.agrees is True
        again = dispatch(*args)  # fused from now on
        assert calls == [1, 1]
        q, k, cos, sin = args  # an unusual call ([1, T, H, D] with unsqueeze_dim=2): the original
        dispatch(q.transpose(1, 2), k.transpose(1, 2), cos, sin, unsqueeze_dim=2)
        assert calls == [1, 1, 1]
    torch.testing.assert_close(again, first, rtol=1e-5, atol=1e-6)


def test_a_rotary_function_of_another_form_stays_the_original(ops):
    """gpt-oss rotates first/second halves with cos of half the head: not rotate-half."""
    dispatch = cpu_fused.RopeDispatch(modeling_gpt_oss.apply_rotary_pos_emb, "gpt_oss")
    args = _rope_args(16, 8)
    with cpu_fused.active(ops):
        want = dispatch(*args)
        assert dispatch.agrees is False
        got = dispatch(*args)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert "gave other values than gpt_oss.apply_rotary_pos_emb" in cpu_fused.describe_rope(
        [dispatch])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engine_logs_which_paths_run_and_answers_alike_with_and_without_them(
        make_llm, tiny_model, monkeypatch, caplog, dtype):
    params = wire.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 6, 7], list(range(100, 160))]
    caplog.set_level(logging.INFO, logger="shoal.engine.worker.cpu.backend")
    fast = make_llm(tiny_model, dtype=dtype, max_model_len=256)
    runner = fast.engine_core.model_executor.worker.model_runner
    fused = runner.cpu.fused
    assert (fused.norms, fused.mlps) == (9, 4)  # 2 per layer + final; 4 layers
    assert "norms and activations: fused RMSNorm (9) and SiLU-gated MLP (4) layers" in caplog.text
    assert "rotary embedding: fused (modeling_llama)" in caplog.text
    got = [o.outputs[0].token_ids for o in fast.generate(prompts, params)]
    monkeypatch.setenv(cpu_fused.DISABLE_ENV, "0")
    plain = make_llm(tiny_model, dtype=dtype, max_model_len=256)
    assert plain.engine_core.model_executor.worker.model_runner.cpu.fused.ops is None
    assert [o.outputs[0].token_ids for o in plain.generate(prompts, params)] == got
