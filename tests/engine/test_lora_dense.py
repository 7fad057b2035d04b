"""LoRALinear's dense form (every slot in two GEMMs, a mask per token) against its per-group
form, on the same rows: the form a step with several adapters, or with one adapter's rows
apart, runs."""

from __future__ import annotations

import torch
from shoal.engine.lora.layers import LoRABatch, LoRALinear, active, dense_parts
from torch import nn

SLOTS, RANK = 3, 4


def _layer(dtype) -> LoRALinear:
    torch.manual_seed(0)
    base = nn.Linear(16, 24, bias=False).to(dtype)
    layer = LoRALinear(base, SLOTS, RANK, "cpu")
    layer.set_slot(0, torch.randn(RANK, 16), torch.randn(24, RANK), 2.0)
    layer.set_slot(1, torch.randn(RANK, 16), torch.randn(24, RANK), 0.5)
    layer.set_slot(1, torch.randn(2, 16), torch.randn(24, 2), 0.25)  # a smaller rank after
    layer.set_slot(2, None, None, 0.0)  # an adapter that does not touch this module
    return layer


def _run(layer: LoRALinear, x: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
    with active(batch):
        return layer(x)


def test_dense_equals_per_group_for_mixed_rows_and_the_base():
    # rows 0-2 slot 0, 3-4 base, 5-6 slot 1, 7 slot 0 again, 8 slot 2 (nothing here), 9 base
    spans = {0: [(0, 3), (7, 8)], 1: [(5, 7)], 2: [(8, 9)]}
    groups = [(0, torch.tensor([0, 1, 2, 7])), (1, slice(5, 7)), (2, slice(8, 9))]
    for dtype in (torch.float32, torch.bfloat16):
        layer = _layer(dtype)
        x = torch.randn(10, 16).to(dtype)
        per_group = _run(layer, x, LoRABatch(groups))
        dense = _run(layer, x, LoRABatch(groups, *dense_parts(spans, 10, SLOTS, RANK, "cpu")))
        assert torch.allclose(dense.float(), per_group.float(), rtol=1e-2 if dtype !=
                              torch.float32 else 1e-5, atol=1e-5)
        base = layer.base(x)
        assert torch.equal(dense[[3, 4, 9]], base[[3, 4, 9]])  # base rows: exactly the base
        assert torch.equal(dense[8], base[8])  # a slot with nothing for this module
        assert not torch.equal(dense[0], base[0])


def test_the_dense_parts_give_each_token_its_own_slots_columns():
    spans = {0: [(0, 2)], 1: [(2, 3)]}
    row_slot, mask = dense_parts(spans, 4, SLOTS, RANK, "cpu")
    assert row_slot.tolist() == [0, 0, 1, SLOTS]
    assert mask.shape == (4, SLOTS * RANK)
    assert mask[0, :RANK].tolist() == [1.0] * RANK and mask[0, RANK:].sum() == 0
    assert mask[3].sum() == 0


def test_the_float_copy_is_shared_only_by_siblings_reading_the_same_input():
    batch = LoRABatch([(0, slice(0, 2))])
    attn, mlp = "model.layers.0.self_attn", "model.layers.0.mlp"
    x = torch.randn(2, 16).to(torch.bfloat16)
    first = batch.as_float(x, attn)
    assert batch.as_float(x, attn) is first  # q, k and v read the same hidden states
    assert batch.as_float(x, mlp) is not first  # another module: cast again
    other = torch.randn(2, 16).to(torch.bfloat16)
    assert torch.equal(batch.as_float(other, mlp), other.float())
    assert batch.as_float(x, None) is not batch.as_float(x, None)  # no scope: never shared
