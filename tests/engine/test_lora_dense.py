"""LoRALinear's forms (one adapter's run of rows; the dense form, every slot and a mask per
token; the segmented form, each adapter's rows through its own slot) against the plain update
`base(x) + scaling * (x @ A.T) @ B.T` of each row's adapter; sibling projections sharing one A
GEMM; the choice between the dense and segmented forms; and what a step's LoRABatch costs to
build: no index tensor per slot, the same few host ops whatever the number of adapters and
runs."""

from __future__ import annotations

import collections

import pytest
import torch
from shoal.engine.lora.adapter import LoRAWeights, ModuleLoRA
from shoal.engine.lora.config import LoRAConfig
from shoal.engine.lora.layers import LoRABatch, LoRALinear, active, dense_mask
from shoal.engine.lora.manager import LoRAManager, segmented_pays, wrap_model
from shoal.engine.wire import LoRARequest
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

SLOTS, RANK = 3, 4
# slot -> (A, B, scaling), a rank below RANK in slot 1; slot 2: nothing for this module
WEIGHTS = {0: (RANK, 2.0), 1: (2, 0.25), 2: None}


def _layer(dtype) -> tuple[LoRALinear, dict]:
    torch.manual_seed(0)
    base = nn.Linear(16, 24, bias=False).to(dtype)
    layer = LoRALinear(base, SLOTS, RANK, "cpu")
    layer.set_slot(1, torch.randn(RANK, 16), torch.randn(24, RANK), 0.5)  # replaced below
    held = {}
    for slot, w in WEIGHTS.items():
        if w is None:
            layer.set_slot(slot, None, None, 0.0)
            continue
        r, scaling = w
        held[slot] = (torch.randn(r, 16), torch.randn(24, r), scaling)
        layer.set_slot(slot, *held[slot])
    return layer, held


def _plain(layer: LoRALinear, held: dict, x: torch.Tensor, row_slot: list[int]) -> torch.Tensor:
    """Each row's update computed alone, in float32, added before rounding back."""
    y = layer.base(x).float()
    for i, s in enumerate(row_slot):
        if s in held:
            a, b, scaling = held[s]
            y[i] += (x[i].float() @ a.T) @ b.T * scaling
    return y.to(x.dtype)


def _run(layer: LoRALinear, x: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
    with active(batch):
        return layer(x)


def _dense(row_slot: list[int]) -> LoRABatch:
    used = tuple(dict.fromkeys(s for s in row_slot if s != SLOTS))
    return LoRABatch(None, None, dense_mask(row_slot, SLOTS, "cpu"), used)


def test_the_dense_form_equals_each_rows_own_update():
    # rows 0-2 slot 0, 3-4 base, 5-6 slot 1, 7 slot 0 again, 8 slot 2 (nothing here), 9 base
    row_slot = [0, 0, 0, SLOTS, SLOTS, 1, 1, 0, 2, SLOTS]
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        layer, held = _layer(dtype)
        x = torch.randn(10, 16).to(dtype)
        dense = _run(layer, x, _dense(row_slot))
        want = _plain(layer, held, x, row_slot)
        assert torch.allclose(dense.float(), want.float(), rtol=tol, atol=1e-4)
        base = layer.base(x)
        assert torch.equal(dense[[3, 4, 9]], base[[3, 4, 9]])  # base rows: exactly the base
        assert torch.equal(dense[8], base[8])  # a slot with nothing for this module
        assert not torch.equal(dense[0], base[0])


def test_one_adapters_run_of_rows_touches_only_those_rows():
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        layer, held = _layer(dtype)
        x = torch.randn(10, 16).to(dtype)
        for slot in (0, 1):
            got = _run(layer, x, LoRABatch(slot, slice(2, 7), None, (slot,)))
            row_slot = [slot if 2 <= i < 7 else SLOTS for i in range(10)]
            assert torch.allclose(got.float(), _plain(layer, held, x, row_slot).float(),
                                  rtol=tol, atol=1e-4)
            base = layer.base(x)
            assert torch.equal(got[:2], base[:2]) and torch.equal(got[7:], base[7:])
        nothing = _run(layer, x, LoRABatch(2, slice(0, 10), None, (2,)))
        assert torch.equal(nothing, layer.base(x))


def test_a_slot_filled_again_forgets_the_larger_rank_before():
    layer, held = _layer(torch.float32)  # slot 1 had rank RANK, then rank 2
    assert layer.ranks == [RANK, 2, 0]
    assert layer.shared.a_slot[1, 2:].abs().sum() == 0 and layer.lora_b[:, RANK + 2:
                                                                        2 * RANK].abs().sum() == 0


class _Ops(TorchDispatchMode):
    """The aten ops dispatched inside, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _attention(dtype=torch.float32) -> tuple[nn.Module, dict[str, LoRALinear]]:
    torch.manual_seed(1)
    attn = nn.Module()
    for name, out in (("q_proj", 16), ("k_proj", 8), ("v_proj", 8), ("o_proj", 16)):
        setattr(attn, name, nn.Linear(16, out, bias=False, dtype=dtype))
    parent = nn.Module()
    parent.self_attn = attn
    layers = wrap_model(parent, SLOTS, RANK, "cpu")
    for i, layer in enumerate(layers.values()):
        for slot in range(SLOTS):
            layer.set_slot(slot, torch.randn(RANK, 16), torch.randn(layer.out_features, RANK),
                           1.0 + i + slot)
    return attn, layers


def test_q_k_v_share_one_a_gemm_and_a_new_input_is_not_mistaken_for_it():
    attn, layers = _attention()
    qkv = [layers[f"self_attn.{n}_proj"] for n in "qkv"]
    assert {id(layer.shared) for layer in qkv} == {id(qkv[0].shared)}
    assert qkv[0].shared.members == 3 and layers["self_attn.o_proj"].shared.members == 1
    x = torch.randn(5, 16)
    row_slot = [0, 2, SLOTS, 1, 0]
    alone = []
    for layer in qkv:  # each projection's update with its own A GEMM: a fresh batch each
        alone.append(_run(layer, x, _dense(row_slot)))
    batch = _dense(row_slot)
    with _Ops() as base:
        [layer.base(x) for layer in qkv]
    with active(batch), _Ops() as seen:
        shared = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]
    for a, b in zip(alone, shared, strict=True):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)
    seen.ops.subtract(base.ops)
    # one A GEMM and one mask multiply for the three; per member one B GEMM and one add
    assert (seen.ops["mm"], seen.ops["mul_"], seen.ops["add_"]) == (4, 1, 3), seen.ops
    other = torch.randn(5, 16)
    with active(batch):
        attn.q_proj(x)
        got = attn.k_proj(other)  # not the input q read: its own A GEMM
    assert torch.allclose(got, _run(qkv[1], other, _dense(row_slot)), rtol=1e-6, atol=1e-6)


def _manager(slots: int, device="cpu", dtype=torch.float32) -> tuple[LoRAManager, list]:
    attn = nn.Module()
    for name in ("q_proj", "k_proj"):
        setattr(attn, name, nn.Linear(16, 8 if name == "k_proj" else 16, bias=False,
                                      device=device, dtype=dtype))
    model = nn.Module()
    model.self_attn = attn
    manager = LoRAManager(model, LoRAConfig(max_loras=slots, max_lora_rank=RANK), device)
    reqs = [LoRARequest(f"a{i}", i + 1, f"/nowhere/a{i}") for i in range(slots)]
    for i, req in enumerate(reqs):  # host copies as read_adapter leaves them (float32, CPU)
        manager.host[req.lora_int_id] = LoRAWeights(req, {
            "self_attn.q_proj": ModuleLoRA(torch.randn(RANK, 16), torch.randn(16, RANK), 2.0),
            "self_attn.k_proj": ModuleLoRA(torch.randn(2, 16), torch.randn(8, 2), 0.5 * i)})
    return manager, reqs


def test_a_dense_step_builds_no_index_tensor_per_slot():
    """What manager.batch dispatches: for a mixed step, one mask (picked rows of a host
    identity, copied once), the same ops for 2 rows as for 64 rows of 8 adapters round-robin
    (64 runs); for one adapter's run of rows, no torch op at all."""
    manager, reqs = _manager(8)
    manager.batch(reqs, [1] * 8)  # every adapter into its slot first
    counts = []
    for rows in ([reqs[0], reqs[1]], [reqs[i % 8] for i in range(64)],
                 [reqs[i % 8] if i % 3 else None for i in range(64)]):
        with _Ops() as seen:
            batch = manager.batch(rows, [1] * len(rows))
        assert batch.dense and batch.mask.shape == (len(rows), 8)
        assert not {"arange", "cat", "fill_", "index_put_", "nonzero"} & set(seen.ops)
        counts.append(sum(seen.ops.values()))
    assert len(set(counts)) == 1 and counts[0] <= 4, counts
    with _Ops() as seen:
        one = manager.batch([None, reqs[3], reqs[3], None], [2, 5, 1, 3])
    assert (one.slot, one.rows, one.mask) == (3, slice(2, 8), None) and not seen.ops
    prefill = manager.batch([reqs[3], None, reqs[3]], [2, 1, 3])  # one adapter, rows apart
    assert prefill.dense and prefill.mask[:, 3].tolist() == [1, 1, 0, 1, 1, 1]


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
    dev = torch.device("meta")
    manager, reqs = _manager(2, dev, torch.bfloat16)
    attn = manager.layers["self_attn.q_proj"], manager.layers["self_attn.k_proj"]
    x = torch.randn(7, 16, device=dev, dtype=torch.bfloat16)
    with _OneDevice():
        dense = manager.batch([reqs[0], None, reqs[1], reqs[0]], [2, 1, 3, 1])
        single = manager.batch([reqs[1], None], [3, 4])
        for batch in (dense, single):
            with active(batch):
                q, k = attn[0](x), attn[1](x)
            assert (q.device, q.dtype, k.shape) == (dev, torch.bfloat16, (7, 8))
    assert dense.dense and not single.dense and dense.mask.device == dev
    shared = attn[0].shared
    assert {t.device for t in (shared.a_all, shared.a_slot, *(layer.lora_b for layer in attn))
            } == {dev}


def _segmented(row_slot: list[int], gather: bool) -> LoRABatch:
    used = tuple(dict.fromkeys(s for s in row_slot if s != SLOTS))
    runs = []
    for slot in sorted(used):
        rows = [i for i, s in enumerate(row_slot) if s == slot]
        runs.append((slot, torch.tensor(rows) if gather else slice(rows[0], rows[-1] + 1)))
    return LoRABatch(None, None, None, used, runs=tuple(runs))


def test_the_segmented_form_equals_each_rows_own_update():
    apart = [0, 0, SLOTS, 1, 1, 0, 2, SLOTS, 1, SLOTS]  # each adapter's rows apart: gathered
    runs = [SLOTS, 1, 1, 1, 0, 0, 2, 2, SLOTS, SLOTS]  # each one run: slices
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        layer, held = _layer(dtype)
        x = torch.randn(10, 16).to(dtype)
        for row_slot, gather in ((apart, True), (runs, False)):
            got = _run(layer, x, _segmented(row_slot, gather))
            assert torch.allclose(got.float(), _plain(layer, held, x, row_slot).float(),
                                  rtol=tol, atol=1e-4)
            base = layer.base(x)
            for i, s in enumerate(row_slot):  # base rows and a slot with nothing: untouched
                assert torch.equal(got[i], base[i]) == (s in (2, SLOTS)), (i, s)


def _llama_width(hidden: int, mlp: int, kv: int, layers: int) -> int:
    """segmented_pays' width of a Llama model: shared inputs' in x members, plus every out."""
    ins = hidden * 3 + hidden + hidden * 2 + mlp
    outs = hidden + 2 * kv + hidden + 2 * mlp + hidden
    return layers * (ins + outs)


LARGE = dict(width=_llama_width(4096, 14336, 1024, 8), shared_inputs=32, layers=56, rank=16,
             slots=8)  # benchmarks/lora.py's `large`: Llama-3-8B's layer shape
TINY = dict(width=_llama_width(256, 688, 128, 4), shared_inputs=16, layers=28, rank=16,
            slots=8)


@pytest.mark.parametrize("shape, device, tokens, runs, gathered, pays", [
    # CPU, Llama-8B's width: 8 adapters round-robin, decoding and prefilling (measured:
    # benchmarks/README.md, the segmented form 77% -> 8x% of base)
    (LARGE, "cpu", 64, 8, True, True),
    (LARGE, "cpu", 2048, 8, True, True),
    (LARGE, "cpu", 64, 2, False, True),
    # CPU, the tiny model: ops dominate, the dense form stays (measured 51% against 27%)
    (TINY, "cpu", 64, 8, True, False),
    (TINY, "cpu", 2048, 8, True, True),
    # a GPU: a launch costs what the saved FLOPs do not (measured on an H200: dense won)
    (LARGE, "cuda", 64, 8, True, False),
    (LARGE, "cuda", 2048, 8, True, False),
    (TINY, "cuda", 2048, 8, True, False),
])
def test_segmented_pays(shape, device, tokens, runs, gathered, pays):
    assert segmented_pays(tokens=tokens, runs=runs, gathered=gathered, device_type=device,
                          **shape) is pays


def test_the_manager_takes_the_segmented_form_where_it_pays_and_it_equals_the_dense_one():
    """A CPU model of 1,024 wide projections, 1,024 prompt tokens of 3 adapters interleaved:
    the step is segmented (index tensors), and each projection's output is the dense form's."""
    torch.manual_seed(3)
    attn = nn.Module()
    for name in ("q_proj", "k_proj"):
        setattr(attn, name, nn.Linear(1024, 1024, bias=False))
    model = nn.Module()
    model.self_attn = attn
    manager = LoRAManager(model, LoRAConfig(max_loras=8, max_lora_rank=RANK), "cpu")
    reqs = [LoRARequest(f"a{i}", i + 1, f"/nowhere/a{i}") for i in range(3)]
    for req in reqs:
        manager.host[req.lora_int_id] = LoRAWeights(req, {
            "self_attn.q_proj": ModuleLoRA(torch.randn(RANK, 1024), torch.randn(1024, RANK),
                                           2.0),
            "self_attn.k_proj": ModuleLoRA(torch.randn(2, 1024), torch.randn(1024, 2), 0.5)})
    rows = [reqs[i % 3] if i % 4 else None for i in range(8)]
    batch = manager.batch(rows, [128] * 8)
    assert not batch.dense and [s for s, _ in batch.runs] == [0, 1, 2]
    assert all(isinstance(r, torch.Tensor) and len(r) == 256 for _, r in batch.runs)
    x = torch.randn(1024, 1024)
    per_token = [s for s in (manager.slots.index(r.lora_int_id) if r else 8 for r in rows)
                 for _ in range(128)]
    dense = LoRABatch(None, None, dense_mask(per_token, 8, "cpu"), batch.slots_used)
    for proj in (attn.q_proj, attn.k_proj):
        got, want = _run(proj, x, batch), _run(proj, x, dense)
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-3)
        assert not torch.equal(got, proj.base(x))
