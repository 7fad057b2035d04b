"""LoRALinear: a projection with `max_loras` adapter slots, and the batched low-rank update.

Sibling projections that read the same input (q/k/v; gate/up) share one `SharedInput`: their
A weights stacked, so one GEMM computes every member's `x @ A.T` at once (the first member's
call; the others reuse it). Each adapter's scaling is folded into its B columns when the slot
is filled, so a member's update is one more GEMM and one in-place add:

- one adapter whose rows are one run (`LoRABatch.slot` set, `rows` a slice): per shared input
  `h = x[rows] @ A_slot.T` (the slot's A of every member, [members * max_rank, in]); per member
  `y[rows] += h[:, member's columns] @ B_slot.T`. Base rows cost nothing.
- any other step (several adapters, or one adapter's rows apart), one of two forms, whichever
  the manager's cost model (manager.segmented_pays) finds cheaper on the device:
  - dense, over every slot: `h = x @ A_all.T` ([tokens, members * slots * max_rank]), times a
    per-token 0/1 mask [tokens, slots] built once per step (each token keeps its own slot's
    columns: the others add exact zeros), then per member `y += h[:, member's columns] @
    B_all.T`: the same GEMMs whatever the number of adapters, no gather, scatter or Python loop
    per adapter, and no index tensor; but `slots` times the FLOPs each token needs;
  - segmented, per adapter of the step (`LoRABatch.runs`): its rows (a slice when they are one
    run, else an index tensor: gathered, updated, written back) through its own slot's A and B,
    the FLOPs each token needs, and a few ops per adapter. Where a host op costs little against
    the GEMMs (a CPU, a model of Llama-8B's width) this is the cheaper; where launches dominate
    (a GPU, a small model) the dense form is.

As PEFT does for a half-precision model, the update is computed in float32 and added to the
base output in float32 before it is rounded back (PEFT keeps adapter weights in float32:
autocast_adapter_dtype); the float32 cast of the input happens once per shared input. Outside a
step with a LoRABatch (the load-time probes, a base-only step) the layer is its base layer.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import nn

# Projections that transformers' decoder layers call on one input, in this order of columns.
SHARED_INPUT = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class SharedInput:
    """The A weights of the projections that read one input (one projection alone, or
    siblings from SHARED_INPUT), float32 on the engine's device, in two layouts: `a_all`
    member-major [members * slots * max_rank, in] for the dense form (a member's columns of
    `x @ a_all.T` are one contiguous run over every slot), and `a_slot` slot-major
    [slots, members * max_rank, in] for one adapter's step. A slot's unused rank rows stay
    exact zeros."""

    def __init__(self, members: int, in_features: int, slots: int, max_rank: int,
                 device) -> None:
        self.members, self.slots, self.rank = members, slots, max_rank
        f32 = dict(dtype=torch.float32, device=device)
        self.a_all = torch.zeros(members * slots * max_rank, in_features, **f32)
        self.a_slot = torch.zeros(slots, members * max_rank, in_features, **f32)
        # Transposed views, made once (a view per call is host work).
        self.a_all_t = self.a_all.T
        self.a_slot_t = [self.a_slot[s].T for s in range(slots)]

    def set_a(self, member: int, slot: int, a: torch.Tensor | None) -> None:
        r0 = (member * self.slots + slot) * self.rank
        own, one = self.a_all[r0:r0 + self.rank], self.a_slot[slot, member * self.rank:
                                                              (member + 1) * self.rank]
        own.zero_()
        one.zero_()
        if a is not None:
            own[:a.shape[0]].copy_(a)
            one[:a.shape[0]].copy_(a)


@dataclass
class LoRABatch:
    """One step's LoRA rows. `slot`: the one slot of a step whose adapted rows are one run
    `rows` (a slice of the packed tokens), no mask; None: the dense form over every token
    (`rows` None) with `mask` [tokens, slots], float32, 1.0 where the token's slot is the
    column's. `slots_used`: the step's slots, in order of first use."""

    slot: int | None
    rows: slice | None
    mask: torch.Tensor | None
    slots_used: tuple[int, ...]
    # The segmented form (slot and mask None): per adapter of the step, (its slot, its rows: a
    # slice of the packed tokens, or an int64 index tensor on the device).
    runs: tuple[tuple[int, slice | torch.Tensor], ...] = ()
    # The last shared input's `x @ A.T` (after the mask): q/k/v (and gate/up) read the same
    # hidden states, so the first member computes it for all. Keyed by the SharedInput and the
    # input's storage, held meanwhile so it cannot be reused; in-place changes are not tracked
    # (inference tensors have no version counter), so this never outlives the sibling calls
    # of one forward.
    _shared: SharedInput | None = None
    _src: torch.Tensor | None = None
    _h: torch.Tensor | None = None

    def __post_init__(self) -> None:
        # [tokens, 1, slots, 1]: broadcast over the members and the rank columns of h
        self._mask4 = None if self.mask is None else self.mask[:, None, :, None]

    @property
    def dense(self) -> bool:
        return self.mask is not None

    def hidden(self, shared: SharedInput, x2: torch.Tensor):
        """`x @ A.T` of the shared input: one tensor, or (segmented) one per run."""
        src = self._src
        if (shared is self._shared and src is not None and src.data_ptr() == x2.data_ptr()
                and src.shape == x2.shape and src.stride() == x2.stride()):
            return self._h
        if self.runs:
            h = [torch.mm(_float(x2[rows] if isinstance(rows, slice) else
                                 x2.index_select(0, rows)), shared.a_slot_t[slot])
                 for slot, rows in self.runs]
        elif self.slot is None:
            h = torch.mm(_float(x2), shared.a_all_t)
            h.view(-1, shared.members, shared.slots, shared.rank).mul_(self._mask4)
        else:
            h = torch.mm(_float(x2[self.rows]), shared.a_slot_t[self.slot])
        self._shared, self._src, self._h = shared, x2, h
        return h


def _float(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 else x.float()


def dense_mask(row_slot: list[int], slots: int, device,
               eye: torch.Tensor | None = None) -> torch.Tensor:
    """LoRABatch's mask [tokens, slots] from each token's slot (`slots`: a base row): rows of
    `eye` (torch.eye(slots + 1, slots) on the host, made here if not given) picked on the host,
    then one copy to the device."""
    if eye is None:
        eye = torch.eye(slots + 1, slots)  # row `slots`: a base row, all zeros
    return eye[torch.tensor(row_slot)].to(device)


_ACTIVE: ContextVar[LoRABatch | None] = ContextVar("shoal_lora_batch", default=None)


@contextmanager
def active(batch: LoRABatch | None):
    token = _ACTIVE.set(batch)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, slots: int, max_rank: int, device,
                 shared: SharedInput | None = None, member: int = 0) -> None:
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        # Not Parameters or buffers: engine state, outside state_dict and .to().
        self.shared = shared or SharedInput(1, self.in_features, slots, max_rank, device)
        self.member = member
        self.rank = max_rank
        # B of every slot side by side [out, slots * max_rank], each slot's scaling folded in.
        self.lora_b = torch.zeros(self.out_features, slots * max_rank, dtype=torch.float32,
                                  device=device)
        self.b_t = self.lora_b.T
        self.b_t_slot = [self.b_t[s * max_rank:(s + 1) * max_rank] for s in range(slots)]
        self.ranks = [0] * slots  # 0: the slot holds nothing for this module
        w = slots * max_rank
        self._cols_all = slice(member * w, (member + 1) * w)  # of h, dense form
        self._cols_one = slice(member * max_rank, (member + 1) * max_rank)  # one slot's h

    def set_slot(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None,
                 scaling: float) -> None:
        """Put one adapter's A [r, in] and B [out, r] in a slot (None: the adapter does not
        touch this module); B is kept times scaling."""
        self.shared.set_a(self.member, slot, a)
        b_slot = self.b_t_slot[slot].T  # [out, max_rank]
        b_slot.zero_()
        self.ranks[slot] = 0 if a is None else a.shape[0]
        if a is not None:
            b_slot[:, :a.shape[0]].copy_(b)
            b_slot.mul_(scaling)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = _ACTIVE.get()
        if batch is None:
            return y
        if batch.slot is not None:
            if not self.ranks[batch.slot]:
                return y
        elif not any(self.ranks[s] for s in batch.slots_used):
            return y
        x2 = x.reshape(-1, self.in_features)
        y2 = y.view(-1, self.out_features)
        h = batch.hidden(self.shared, x2)
        if batch.runs:
            for (slot, rows), hs in zip(batch.runs, h, strict=True):
                if not self.ranks[slot]:
                    continue
                delta = torch.mm(hs[:, self._cols_one], self.b_t_slot[slot])
                if isinstance(rows, slice):
                    y2[rows].add_(delta)
                elif y2.dtype == torch.float32:
                    y2.index_add_(0, rows, delta)  # each row once: y + delta
                else:  # added in float32, rounded once, as the other forms
                    y2.index_copy_(0, rows, delta.add_(y2.index_select(0, rows)).to(y2.dtype))
        elif batch.slot is None:
            y2.add_(torch.mm(h[:, self._cols_all], self.b_t))
        else:
            # in place: a bf16 y and a float32 delta add in float32, rounded once
            y2[batch.rows].add_(torch.mm(h[:, self._cols_one], self.b_t_slot[batch.slot]))
        return y

    def extra_repr(self) -> str:
        return (f"slots={len(self.ranks)}, max_rank={self.rank}, "
                f"shared input member {self.member} of {self.shared.members}")
