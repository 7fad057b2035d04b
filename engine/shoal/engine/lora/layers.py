"""LoRALinear: a projection with `max_loras` adapter slots, and the batched low-rank update.

Each step the runner sets a LoRABatch (the context below): for every device slot used this step,
the packed-batch tokens that run with it (a slice when they are contiguous, else an index
tensor). The layer computes its base output once for all tokens, then for each slot
`y[rows] += (x[rows] @ A_s.T) @ B_s.T * scaling_s`: two small GEMMs per adapter in the step,
whatever the number of rows; base rows cost nothing. As PEFT does for a half-precision model,
the update is computed in float32 and added to the base output in float32 before it is rounded
back (PEFT keeps adapter weights in float32: autocast_adapter_dtype). Outside a step with a
LoRABatch (the load-time probes, a base-only step) the layer is its base layer.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class LoRABatch:
    """One step's groups: (slot, rows) with rows a slice or a LongTensor of token indices.

    With more than one group, or rows that are not contiguous, the step also carries the
    dense form every layer uses instead (`dense`): each token's slot (`row_slot`, `slots` for a
    base row) and a 0/1 mask [tokens, slots * max_rank] that keeps only the token's own slot's
    columns. Then one layer's update is two GEMMs over every slot at once,
    `((x @ A_all.T) * mask) @ B_all.T`, times each row's scaling: the same products as the
    per-group form (the other slots' columns add exact zeros), without a gather, a scatter or
    a Python loop per adapter."""

    groups: list[tuple[int, slice | torch.Tensor]]
    row_slot: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    # The float32 copy of the last input: q/k/v (and gate/up) read the same hidden states, so
    # it is cast once per module and step instead of once per projection. Keyed by the
    # projections' parent module (their scope) and the input's storage, held meanwhile so it
    # cannot be reused; in-place changes are not tracked (inference tensors have no version
    # counter), so a scope never outlives the sibling calls of one forward.
    _scope: str | None = None
    _src: torch.Tensor | None = None
    _f32: torch.Tensor | None = None

    @property
    def dense(self) -> bool:
        return self.mask is not None

    def as_float(self, x2: torch.Tensor, scope: str | None = None) -> torch.Tensor:
        if x2.dtype == torch.float32:
            return x2
        src = self._src
        if (scope is not None and scope == self._scope and src is not None
                and src.data_ptr() == x2.data_ptr() and src.shape == x2.shape):
            return self._f32
        self._scope, self._src, self._f32 = scope, x2, x2.float()
        return self._f32


def dense_parts(spans: dict[int, list[tuple[int, int]]], tokens: int, slots: int, max_rank: int,
                device) -> tuple[torch.Tensor, torch.Tensor]:
    """row_slot [tokens] and mask [tokens, slots * max_rank] for LoRABatch's dense form."""
    row_slot = torch.full((tokens,), slots, dtype=torch.long)
    for slot, ranges in spans.items():
        for a, b in ranges:
            row_slot[a:b] = slot
    cols = torch.arange(slots * max_rank) // max_rank
    mask = (row_slot[:, None] == cols[None, :]).to(torch.float32)
    return row_slot.to(device), mask.to(device)


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
                 scope: str | None = None) -> None:
        super().__init__()
        self.base = base
        self.scope = scope  # the parent module's name: siblings share their input's float32 copy
        self.in_features, self.out_features = base.in_features, base.out_features
        f32 = dict(dtype=torch.float32, device=device)
        # Not Parameters or buffers: engine state, outside state_dict and .to().
        self.lora_a = torch.zeros(slots, max_rank, self.in_features, **f32)
        self.lora_b = torch.zeros(slots, self.out_features, max_rank, **f32)
        self.ranks = [0] * slots  # 0: the slot holds nothing for this module
        self.scalings = [0.0] * slots
        # The dense form's copies: B of every slot side by side [out, slots * max_rank], and
        # each slot's scaling (index `slots`: a base row, 0). Unused columns stay exact zeros.
        self.b_all = torch.zeros(self.out_features, slots * max_rank, **f32)
        self.scale_of = torch.zeros(slots + 1, **f32)

    def set_slot(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None,
                 scaling: float) -> None:
        """Put one adapter's A [r, in] and B [out, r] in a slot (None: the adapter does not
        touch this module)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        b_slot = self.b_all.view(self.out_features, -1, self.lora_a.shape[1])[:, slot]
        b_slot.zero_()
        self.scale_of[slot] = 0.0
        if a is None:
            self.ranks[slot] = 0
            return
        r = a.shape[0]
        self.lora_a[slot, :r].copy_(a)
        self.lora_b[slot, :, :r].copy_(b)
        b_slot[:, :r].copy_(b)
        self.ranks[slot], self.scalings[slot] = r, scaling
        self.scale_of[slot] = scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = _ACTIVE.get()
        if batch is None:
            return y
        x2 = x.reshape(-1, self.in_features)
        y2 = y.view(-1, self.out_features)
        if batch.dense:
            self._dense(x2, y2, batch)
            return y
        for slot, rows in batch.groups:
            r = self.ranks[slot]
            if r == 0:
                continue
            xs = batch.as_float(x2, self.scope)[rows]
            a, b = self.lora_a[slot, :r], self.lora_b[slot, :, :r]
            delta = (xs @ a.T) @ b.T * self.scalings[slot]
            if isinstance(rows, slice):
                # in place: a bf16 y and a float32 delta add in float32, rounded once (the
                # same as (y.float() + delta).to(bf16), in one pass)
                y2[rows] += delta
            elif y2.dtype == torch.float32:
                y2.index_add_(0, rows, delta)
            else:
                y2[rows] = (y2[rows].float() + delta).to(y2.dtype)
        return y

    def _dense(self, x2: torch.Tensor, y2: torch.Tensor, batch: LoRABatch) -> None:
        xs = batch.as_float(x2, self.scope)
        h = torch.mm(xs, self.lora_a.view(-1, self.in_features).T)
        h.mul_(batch.mask)
        delta = torch.mm(h, self.b_all.T)
        # in place, computed in float32 and rounded once (as the per-group form)
        y2.addcmul_(delta, self.scale_of[batch.row_slot].unsqueeze(1))

    def extra_repr(self) -> str:
        return f"slots={self.lora_a.shape[0]}, max_rank={self.lora_a.shape[1]}"
