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
    """One step's groups: (slot, rows) with rows a slice or a LongTensor of token indices."""

    groups: list[tuple[int, slice | torch.Tensor]]


_ACTIVE: ContextVar[LoRABatch | None] = ContextVar("shoal_lora_batch", default=None)


@contextmanager
def active(batch: LoRABatch | None):
    token = _ACTIVE.set(batch)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, slots: int, max_rank: int, device) -> None:
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        f32 = dict(dtype=torch.float32, device=device)
        # Not Parameters or buffers: engine state, outside state_dict and .to().
        self.lora_a = torch.zeros(slots, max_rank, self.in_features, **f32)
        self.lora_b = torch.zeros(slots, self.out_features, max_rank, **f32)
        self.ranks = [0] * slots  # 0: the slot holds nothing for this module
        self.scalings = [0.0] * slots

    def set_slot(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None,
                 scaling: float) -> None:
        """Put one adapter's A [r, in] and B [out, r] in a slot (None: the adapter does not
        touch this module)."""
        if a is None:
            self.ranks[slot] = 0
            return
        r = a.shape[0]
        self.lora_a[slot, :r].copy_(a)
        self.lora_b[slot, :, :r].copy_(b)
        self.ranks[slot], self.scalings[slot] = r, scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = _ACTIVE.get()
        if batch is None:
            return y
        x2 = x.reshape(-1, self.in_features)
        y2 = y.view(-1, self.out_features)
        for slot, rows in batch.groups:
            r = self.ranks[slot]
            if r == 0:
                continue
            xs = x2[rows]
            if xs.dtype != torch.float32:
                xs = xs.float()
            a, b = self.lora_a[slot, :r], self.lora_b[slot, :, :r]
            delta = (xs @ a.T) @ b.T * self.scalings[slot]
            if y2.dtype == torch.float32:
                if isinstance(rows, slice):
                    y2[rows] += delta
                else:
                    y2.index_add_(0, rows, delta)
            else:
                y2[rows] = (y2[rows].float() + delta).to(y2.dtype)
        return y

    def extra_repr(self) -> str:
        return f"slots={self.lora_a.shape[0]}, max_rank={self.lora_a.shape[1]}"
