"""LoRALinear's dense form (every slot in two GEMMs, a mask per token) against its per-group
form, on the same rows: the form a step with several adapters, or with one adapter's rows
apart, runs."""

from __future__ import annotations

import torch
from shoal.engine.lora.layers import LoRABatch, LoRALinear, active, dense_parts
from torch import nn
from torch.overrides import TorchFunctionMode

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


class _OneDevice(TorchFunctionMode):
    """Fails every torch op whose tensor arguments lie on two devices (a 0-d CPU scalar aside),
    but the copies that move data on purpose. On the meta device a CPU tensor is often taken
    silently (torch.mm of meta and CPU runs): this mode is what catches it."""

    MOVES = {torch.Tensor.to, torch.Tensor.copy_}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        devices = {t.device for t in _tensors((args, kwargs))
                   if not (t.device.type == "cpu" and t.dim() == 0)}
        if len(devices) > 1 and func not in self.MOVES:
            raise AssertionError(f"{getattr(func, '__name__', func)} mixes devices {devices}")
        return func(*args, **kwargs)


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


def test_slots_and_every_op_of_a_step_stay_on_the_engines_device():
    # What CUDA needs, checked without a GPU: the model on "meta" (another device than the
    # host's adapters), A/B read on the host as read_adapter gives them; the manager's slot
    # fill, the dense and one-adapter forms' per-step parts and every layer op on that device.
    from shoal.engine.lora.adapter import LoRAWeights, ModuleLoRA
    from shoal.engine.lora.config import LoRAConfig
    from shoal.engine.lora.manager import LoRAManager
    from shoal.engine.wire import LoRARequest

    dev = torch.device("meta")
    attn = nn.Module()
    for name in ("q_proj", "k_proj"):
        setattr(attn, name, nn.Linear(16, 8 if name == "k_proj" else 16, bias=False,
                                      device=dev, dtype=torch.bfloat16))
    model = nn.Module()
    model.self_attn = attn
    manager = LoRAManager(model, LoRAConfig(max_loras=2, max_lora_rank=RANK), dev)
    reqs = [LoRARequest(f"a{i}", i + 1, f"/nowhere/a{i}") for i in range(2)]
    for i, req in enumerate(reqs):  # host copies as read_adapter leaves them (float32, CPU)
        manager.host[req.lora_int_id] = LoRAWeights(req, {
            "self_attn.q_proj": ModuleLoRA(torch.randn(RANK, 16), torch.randn(16, RANK), 2.0),
            "self_attn.k_proj": ModuleLoRA(torch.randn(2, 16), torch.randn(8, 2), 0.5 * i)})
    layers = manager.layers.values()
    x = torch.randn(7, 16, device=dev, dtype=torch.bfloat16)
    with _OneDevice():
        dense = manager.batch([reqs[0], None, reqs[1], reqs[0]], [2, 1, 3, 1])
        single = manager.batch([reqs[1], None], [3, 4])
        for batch in (dense, single):
            with active(batch):
                q, k = attn.q_proj(x), attn.k_proj(x)
            assert (q.device, q.dtype, k.shape) == (dev, torch.bfloat16, (7, 8))
    assert dense.dense and not single.dense
    assert {t.device for t in (dense.row_slot, dense.mask, dense.groups[0][1])} == {dev}
    assert {t.device for layer in layers for t in (layer.lora_a, layer.lora_b, layer.b_all,
                                                   layer.scale_of)} == {dev}
