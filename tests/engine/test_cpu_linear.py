"""oneDNN-packed linear layers: equal to nn.Linear within float32 rounding (in bf16 its bits, or
one bf16 step in rare elements with a bias), a row's result independent of its batch, tied
weights left alone, and a switch back to torch's own linear."""

from __future__ import annotations

import pytest
import torch
from shoal.engine.worker.cpu import linear as cpu_linear
from shoal.engine.worker.cpu.linear import PackedLinear
from torch import nn


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(0, 256), (1, 256), (7, 768), (200, 256), (2, 37, 256)])
def test_packed_linear_equals_nn_linear(shape, bias):
    torch.manual_seed(0)
    lin = nn.Linear(shape[-1], 1000, bias=bias)
    x = torch.randn(shape)
    packed = PackedLinear(lin)
    got = packed(x)
    want = lin(x)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    double = x.double() @ lin.weight.double().T + (lin.bias.double() if bias else 0)
    torch.testing.assert_close(got.double(), double, rtol=1e-5, atol=1e-5)


def test_a_strided_input_gives_the_same_rows_as_a_contiguous_one():
    torch.manual_seed(1)
    packed = PackedLinear(nn.Linear(256, 512))
    wide = torch.randn(1, 50, 512)
    x = wide[:, 5:42, ::2]  # the shape of logits_to_keep's slice, here with a stride
    torch.testing.assert_close(packed(x), packed(x.contiguous()), rtol=0, atol=0)


def test_a_row_does_not_depend_on_its_batch():
    torch.manual_seed(2)
    packed = PackedLinear(nn.Linear(256, 8192, bias=False))
    batch = torch.randn(200, 256)
    together = packed(batch)
    for r in (0, 7, 199):
        assert torch.equal(packed(batch[r:r + 1])[0], together[r])


class _Tiny(nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.proj = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16, bias=False))
        self.bf16 = nn.Linear(16, 16).to(torch.bfloat16)
        self.head = nn.Linear(16, 64, bias=False)
        if tied:
            self.head.weight = self.embed.weight


def test_pack_linears_swaps_float32_layers_and_keeps_tied_ones():
    """bf16 layers too where the CPU computes bf16 natively, else they stay torch's."""
    native = cpu_linear.cpu_has_native_bf16()
    model = _Tiny(tied=True)
    count, how = cpu_linear.pack_linears(model)
    assert count == 2 + native and "oneDNN" in how and "1 tied" in how
    assert all(type(m) is PackedLinear for m in model.proj)
    assert type(model.head) is nn.Linear and model.head.weight is model.embed.weight
    assert type(model.bf16) is (PackedLinear if native else nn.Linear)

    untied = _Tiny(tied=False)
    assert cpu_linear.pack_linears(untied)[0] == 3 + native
    assert type(untied.head) is PackedLinear


@pytest.mark.skipif(not cpu_linear.cpu_has_native_bf16(), reason="no native bf16 on this CPU")
@pytest.mark.parametrize("shape", [(1, 256), (200, 256), (2, 37, 256)])
def test_a_packed_bf16_layer_gives_torchs_bits(shape):
    """Without a bias, torch's bits; with one (Qwen2's q/k/v), a rare element one bf16 step
    away (the two round the product and add the bias in another order), no further from the
    exact result."""
    from shoal.engine.worker.cpu.fused import same_values

    torch.manual_seed(3)
    x = torch.randn(shape).to(torch.bfloat16)
    plain = nn.Linear(256, 688, bias=False).to(torch.bfloat16)
    got = PackedLinear(plain)(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, plain(x))
    biased = nn.Linear(256, 688).to(torch.bfloat16)
    got, want = PackedLinear(biased)(x), biased(x)
    assert same_values(got, want)
    exact = x.double() @ biased.weight.double().T + biased.bias.double()
    assert (got.double() - exact).abs().max() <= (want.double() - exact).abs().max() * 1.01


def test_the_switch_keeps_torchs_own_linear(monkeypatch):
    monkeypatch.setenv(cpu_linear.DISABLE_ENV, "0")
    model = _Tiny(tied=False)
    count, how = cpu_linear.pack_linears(model)
    assert count == 0 and cpu_linear.DISABLE_ENV in how
    assert type(model.head) is nn.Linear


def test_the_engine_runs_its_linear_layers_packed_and_says_so(make_llm, tiny_model, caplog):
    caplog.set_level("INFO")
    llm = make_llm(tiny_model, dtype="float32", max_model_len=256)
    runner = llm.engine_core.model_executor.worker.model_runner
    # tiny: 4 layers x (q, k, v, o, gate, up, down) + the untied LM head
    assert runner.cpu.packed_linears == 29
    assert type(runner.model.lm_head) is PackedLinear
    assert "oneDNN-packed linear layers (29)" in caplog.text
