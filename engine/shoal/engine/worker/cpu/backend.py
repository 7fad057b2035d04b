"""CpuBackend: the one hook between the model runner and the CPU backend's modules.

The runner makes one per model and calls it at three points: `prepare` after the weights are
loaded (pack the linears, fuse the norms and MLPs, put the RoPE dispatcher in front), `active()`
around every forward (the fused ops, RoPE's stand-in included), and `load_decode_kernel` once
the probe knows the cache's geometry. Off the CPU, or in a dtype the kernels do not take, every
call leaves transformers' and torch's own code in place. Each decision is logged.
"""

from __future__ import annotations

import logging

import torch
from shoal.engine.worker.cpu import decode_kernel, fused, linear
from shoal.engine.worker.cpu.decode_kernel import PagedDecodeKernel
from shoal.engine.worker.cpu.linear import cpu_has_native_bf16

__all__ = ["CpuBackend", "cpu_has_native_bf16"]

log = logging.getLogger(__name__)


class CpuBackend:
    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.applies = device.type == "cpu" and dtype in fused.DTYPES  # float32, bfloat16
        self.packed_linears = 0  # layers on oneDNN's packed linear (linear.py)
        self.fused = fused.Fused()  # norms, MLPs and RoPE on fused CPU ops (fused.py)
        self.decode_kernel: PagedDecodeKernel | None = None

    def prepare(self, model: torch.nn.Module) -> None:
        """Swap in the packed linears and fused ops, each only where a probe proved it equal."""
        if not self.applies:
            return
        self.packed_linears, how = linear.pack_linears(model)
        log.info("linear layers: %s", how)
        self.fused = fused.fuse(model)
        log.info("norms and activations: %s", self.fused.how)

    def active(self):
        """Context manager around a forward: the fused ops (and RoPE's stand-in) act inside."""
        return fused.active(self.fused.ops)

    def probed(self) -> None:
        """After the first forward (the model probe): RoPE's stand-in has been checked."""
        if self.fused.ops is not None:
            log.info("rotary embedding: %s", fused.describe_rope(self.fused.rope))

    @property
    def argmax(self):
        """The fused argmax over logit rows, or None (torch's)."""
        return self.fused.ops.argmax if self.fused.ops is not None else None

    def load_decode_kernel(self, head_dim: int, block_size: int, num_heads: int,
                           num_kv_heads: int) -> None:
        """The CPU paged-decode kernel where it applies; the torch path otherwise (logged)."""
        if not self.applies:
            return
        unfit = decode_kernel.fits(head_dim, block_size, num_heads, num_kv_heads)
        if unfit:
            log.info("decode attention: torch gather + SDPA (outside the CPU kernel's limits: %s)",
                     unfit)
            return
        self.decode_kernel, how = decode_kernel.load()
        if self.decode_kernel is None:
            log.warning("decode attention: torch gather + SDPA; the CPU paged-decode kernel is "
                        "unavailable: %s", how)
        else:
            log.info("decode attention: CPU paged-decode kernel (%s)", how)
