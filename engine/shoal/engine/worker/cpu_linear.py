"""float32 linear layers on the CPU through oneDNN, with each weight packed once at load.

Why: torch's float32 `F.linear` on the CPU is MKL's GEMM on the weight as stored. On the 2-core
AVX2 EPYC where this was measured (benchmarks/README.md, "Linear layers") that ran the LM head
(200 x 256 x 8192) at 58-72 GFLOP/s and a handful of decode rows far slower; oneDNN's
`_linear_pointwise` over a weight reordered once into its own blocked layout ran the same LM head
at 101-116, most decode and prefill shapes 1.1-1.8x faster, and a row's result does not depend on
the batch it is in (MKL's does). It is the op torch's inductor and vLLM's CPU backend build on.

Which layers: every module of exact type `nn.Linear` with a float32 weight on the CPU that no
other parameter shares (a tied LM head stays as it is: packing it would hold the embedding table
twice). bfloat16 is left to torch, which already runs it on oneDNN where the CPU computes it
natively. `SHOAL_CPU_PACKED_LINEAR=0`, or a torch without the op, keeps torch's own linear; the
engine logs which it runs.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

log = logging.getLogger(__name__)

DISABLE_ENV = "SHOAL_CPU_PACKED_LINEAR"


class PackedLinear(nn.Module):
    """nn.Linear's forward over a oneDNN-packed copy of its weight (the dense one is dropped)."""

    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = lin.in_features, lin.out_features
        with torch.no_grad():
            # Not a Parameter: an opaque oneDNN tensor, outside state_dict and .to().
            self.packed = torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach(), None)
        self.bias = lin.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, oneDNN-packed")


def _unavailable() -> str | None:
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return f"{DISABLE_ENV}=0"
    if not torch.backends.mkldnn.is_available():
        return "this torch was built without oneDNN"
    try:  # the private ops this module relies on, tried once on a toy layer
        PackedLinear(nn.Linear(4, 4))(torch.zeros(1, 4))
    except (AttributeError, RuntimeError) as e:
        return f"oneDNN's packed linear is unavailable: {e}"
    return None


def pack_linears(model: nn.Module) -> tuple[int, str]:
    """Swap the model's packable linear layers for PackedLinear in place.

    Returns how many were packed and a line for the log that says which path runs and why."""
    why = _unavailable()
    if why is not None:
        return 0, f"torch's own (MKL) float32 linear layers: {why}"
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[p.data_ptr()] = uses.get(p.data_ptr(), 0) + 1
    count, tied = 0, 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (type(child) is not nn.Linear or child.weight.dtype != torch.float32
                    or child.weight.device.type != "cpu"):
                continue
            if uses[child.weight.data_ptr()] > 1:
                tied += 1
                continue
            setattr(parent, name, PackedLinear(child))
            count += 1
    kept = f"; {tied} tied to another parameter kept as they are" if tied else ""
    return count, f"oneDNN-packed float32 linear layers ({count}{kept})"
