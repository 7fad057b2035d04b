"""Linear layers on the CPU through oneDNN, with each weight packed once at load.

Why: torch's float32 `F.linear` on the CPU is MKL's GEMM on the weight as stored. On the 2-core
AVX2 EPYC where this was measured (benchmarks/README.md, "Linear layers") that ran the LM head
(200 x 256 x 8192) at 58-72 GFLOP/s and a handful of decode rows far slower; oneDNN's
`_linear_pointwise` over a weight reordered once into its own blocked layout ran the same LM head
at 101-116, most decode and prefill shapes 1.1-1.8x faster, and a row's result does not depend on
the batch it is in (MKL's does). It is the op torch's inductor and vLLM's CPU backend build on.
In bfloat16 torch's own linear is already oneDNN, but it prepares the weight on every call: on
the 2-core AVX-512 EPYC the packed tiny-model layers gave the same bits in 0.75-0.9x the time at
200 rows, and the LM head of one decode row took 82 instead of 251 us. bfloat16 layers are packed
only where the CPU computes bf16 natively (AVX512-BF16 or AMX: where `--dtype auto` picks it).

Which layers: every module of exact type `nn.Linear` with a float32 (or, as above, bfloat16)
weight on the CPU that no other parameter shares (a tied LM head stays as it is: packing it
would hold the embedding table twice). `SHOAL_CPU_PACKED_LINEAR=0`, or a torch without the op,
keeps torch's own linear; the engine logs which it runs.
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


def cpu_has_native_bf16() -> bool:
    """The CPU computes bf16 natively (AVX512-BF16 or AMX)."""
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:  # a torch without these probes
        return False


def packable_dtypes() -> tuple[torch.dtype, ...]:
    return (torch.float32, torch.bfloat16) if cpu_has_native_bf16() else (torch.float32,)


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
        return 0, f"torch's own linear layers: {why}"
    dtypes = packable_dtypes()
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[p.data_ptr()] = uses.get(p.data_ptr(), 0) + 1
    count, tied = 0, 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (type(child) is not nn.Linear or child.weight.dtype not in dtypes
                    or child.weight.device.type != "cpu"):
                continue
            if uses[child.weight.data_ptr()] > 1:
                tied += 1
                continue
            setattr(parent, name, PackedLinear(child))
            count += 1
    kept = f"; {tied} tied to another parameter kept as they are" if tied else ""
    return count, f"oneDNN-packed linear layers ({count}{kept})"
