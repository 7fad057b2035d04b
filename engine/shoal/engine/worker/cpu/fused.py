"""Fused norms, gated-MLP activations and rotary embeddings on the CPU (float32 and bfloat16),
swapped in at load wherever a probe shows they compute what the model's own code computes.

Why: after the linear layers (linear.py), a prefill step's largest cost was torch's eager
elementwise ops, each writing a fresh [tokens, width] tensor: an RMSNorm is five of them (pow,
mean, add, rsqrt, two muls), RoPE six per q and k (two muls, a neg, a cat, a mul, an add), a
SiLU-gated MLP two more around its projections.
- RMSNorm -> FusedRMSNorm: fused_ops.c, one pass per row, one output tensor.
- SiLU-gated MLP (gate_proj, up_proj, down_proj, a SiLU act_fn) -> FusedSiluMLP: the activation
  and the product written in place into gate_proj's output, no temporaries.
- apply_rotary_pos_emb (rotate-half form, full or partial rotation) -> fused_ops.c, one output
  tensor for q and one for k, through a RopeDispatch (below).

Which modules: every module whose class name ends in "RMSNorm" with a 1-d float32 or bfloat16
weight and an eps, and every module with that MLP's attributes. Each is run once on a probe input
in its own dtype beside its replacement (Llama-style `w * x_hat`, Gemma-style `(1 + w) * x_hat`
and, in bf16, where the model rounds: NORM_VARIANTS); a module is swapped only if the outputs
agree to the dtype's rounding (`same_values`), so a variant this file does not know stays as
transformers wrote it. In bf16 the kernels round where transformers' bf16 code rounds, so their
outputs are torch's bits (a norm's mean square, summed in another order, can move a rare element
by one bf16 step). Inputs the kernel does not take (another dtype, rows
that are not one stride apart) go to the original forward.

RoPE is a module-level function of each transformers modeling module, called by name from the
attention layers, so its stand-in is installed in that module for the whole process. It acts
only inside `active(ops)`, which ModelRunner sets around its own forwards; everywhere else (a
reference model in the same process, an engine with the switch off) it is the original. Its
first call is checked against the original on real shapes (the load-time probe forward); a
rotary function of another form (gpt-oss) disagrees and stays the original.

Under tensor parallelism this runs after sharding, on every rank alike: an MLP's probe calls its
row-parallel down_proj (an all-reduce) exactly twice on each rank, and the width norms that
all-reduce (DistributedRMSNorm) are left alone. `SHOAL_CPU_FUSED=0`, no compiler or a failed
build keep everything as it is; the engine logs which path runs.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import sys
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from shoal.engine.worker.cpu import c_build
from shoal.engine.worker.tensor_parallel import DistributedRMSNorm
from torch import nn

log = logging.getLogger(__name__)

DISABLE_ENV = "SHOAL_CPU_FUSED"
SOURCE = Path(__file__).with_name("fused_ops.c")
# Rows below which splitting across threads costs more than it saves (per row: `hidden` floats).
MIN_FLOATS_PER_THREAD = 1 << 18
# The argmax reads a value in a fraction of a norm's time (46 us for 200 x 8192 bf16 on two
# threads, ~90 on one): below this many values per thread, waking a second thread costs more.
ARGMAX_MIN_FLOATS_PER_THREAD = 1 << 21
_I64, _PTR, _F32, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int


DTYPES = (torch.float32, torch.bfloat16)  # what the kernels take


class FusedOps:
    """The compiled fused_ops.c."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._rms = {torch.float32: lib.rms_norm_f32, torch.bfloat16: lib.rms_norm_bf16}
        self._rms[torch.float32].argtypes = [_PTR, _I64, _PTR, _F32, _PTR, _I64, _I64, _F32,
                                             _INT]
        self._rms[torch.bfloat16].argtypes = [_PTR, _I64, _PTR, _F32, _INT, _PTR, _I64, _I64,
                                              _F32, _INT]
        self._rope = {torch.float32: lib.rope_f32, torch.bfloat16: lib.rope_bf16}
        for fn in (*self._rms.values(), *self._rope.values()):
            fn.restype = ctypes.c_int
        for fn in self._rope.values():
            fn.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _INT]
        self._argmax = lib.argmax_rows
        self._argmax.restype = ctypes.c_int
        self._argmax.argtypes = [_PTR, _INT, _I64, _I64, _I64, _PTR, _INT]

    def rms_norm(self, x2: torch.Tensor, weight: torch.Tensor, w_offset: float,
                 eps: float, round_twice: bool = True) -> torch.Tensor:
        """x2: [rows, hidden] float32 or bfloat16 (weight alike) with unit stride along hidden ->
        a new contiguous tensor. round_twice: bf16 only (fused_ops.c, rms_norm_bf16)."""
        rows, hidden = x2.shape
        out = torch.empty(rows, hidden, dtype=x2.dtype)
        stride = x2.stride(0)
        fn = self._rms[x2.dtype]
        extra = () if x2.dtype == torch.float32 else (int(round_twice),)

        fn(x2.data_ptr(), stride, weight.data_ptr(), w_offset, *extra, out.data_ptr(), rows, hidden,
           eps, c_build.threads(rows, MIN_FLOATS_PER_THREAD // hidden))
        return out

    def argmax(self, logits: torch.Tensor) -> torch.Tensor | None:
        """logits.max(dim=-1).indices (the first maximum; a NaN counts as the maximum) for
        [rows, vocab] float32 or bfloat16 CPU logits with unit stride along the vocabulary; None
        for anything else (the caller runs torch's)."""
        if not (logits.dim() == 2 and logits.dtype in DTYPES and logits.device.type == "cpu"
                and logits.stride(1) == 1 and logits.shape[1] > 0):
            return None
        rows, cols = logits.shape
        out = torch.empty(rows, dtype=torch.long)
        self._argmax(logits.data_ptr(), int(logits.dtype == torch.bfloat16), logits.stride(0),
                     rows, cols, out.data_ptr(),
                     c_build.threads(rows, ARGMAX_MIN_FLOATS_PER_THREAD // cols))
        return out

    def rope(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """apply_rotary_pos_emb(q, k, cos, sin) for q/k [1, heads, tokens, head_dim] and cos/sin
        [1, tokens, rot_dim]; None for any other layout (the caller runs the original)."""
        if not (q.dim() == k.dim() == 4 and q.shape[0] == k.shape[0] == 1 and cos.dim() == 3
                and q.dtype == k.dtype == cos.dtype == sin.dtype and q.dtype in DTYPES
                and cos.shape == sin.shape and cos.is_contiguous() and sin.is_contiguous()
                and q.stride(-1) == k.stride(-1) == 1 and q.shape[-1] == k.shape[-1]
                and q.shape[2] == k.shape[2] == cos.shape[1] and cos.shape[0] == 1
                and cos.shape[2] % 2 == 0 and cos.shape[2] <= q.shape[-1]
                and q.device.type == "cpu"):
            return None
        tokens, head_dim, rot = q.shape[2], q.shape[-1], cos.shape[2]
        outs = [torch.empty(1, tokens, x.shape[1], head_dim, dtype=q.dtype) for x in (q, k)]
        fn = self._rope[q.dtype]
        for x, out in zip((q, k), outs, strict=True):
            fn(x.data_ptr(), x.stride(2), x.stride(1), out.data_ptr(), tokens, x.shape[1],
               head_dim, cos.data_ptr(), sin.data_ptr(), rot,
               c_build.threads(tokens, MIN_FLOATS_PER_THREAD // (x.shape[1] * head_dim)))
        return outs[0].transpose(1, 2), outs[1].transpose(1, 2)


class FusedRMSNorm(nn.Module):
    """An RMSNorm module's forward on fused_ops.c; the same weight Parameter."""

    def __init__(self, orig: nn.Module, ops: FusedOps, w_offset: float, eps: float,
                 round_twice: bool = True) -> None:
        super().__init__()
        self.weight = orig.weight
        self.eps, self.w_offset, self.ops, self.round_twice = eps, w_offset, ops, round_twice
        self.replaces = type(orig).__name__
        object.__setattr__(self, "_orig_forward", orig.forward)  # not a submodule: no 2nd weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.weight.shape[0]
        if (x.dtype not in DTYPES or x.device.type != "cpu" or x.shape[-1] != hidden
                or x.stride(-1) != 1 or self.weight.dtype != x.dtype):
            return self._orig_forward(x)
        try:
            x2 = x.view(-1, hidden)
        except RuntimeError:  # rows not one stride apart
            return self._orig_forward(x)
        return self.ops.rms_norm(x2, self.weight, self.w_offset, self.eps,
                                 self.round_twice).view(x.shape)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, fused {self.replaces}"


class FusedSiluMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with the activation and product in place in gate's output."""

    def __init__(self, orig: nn.Module) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = orig.gate_proj, orig.up_proj, orig.down_proj
        self.replaces = type(orig).__name__

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)
        F.silu(gate, inplace=True).mul_(self.up_proj(x))
        return self.down_proj(gate)

    def extra_repr(self) -> str:
        return f"fused {self.replaces}"


# The fused ops of the forward running in this context (ModelRunner sets it around its model
# calls): transformers' apply_rotary_pos_emb is a module-level function, so its replacement is
# installed process-wide and must not change any other model's forward in the process.
_ACTIVE: ContextVar[FusedOps | None] = ContextVar("shoal_fused_ops", default=None)


@contextmanager
def active(ops: FusedOps | None):
    token = _ACTIVE.set(ops)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


class RopeDispatch:
    """Stands in for one modeling module's apply_rotary_pos_emb. Outside a Shoal forward, or
    for an unusual call, it is the original. Its first fast-path call inside one runs both and
    keeps the original's result; the fused path is used from then on only if they agreed."""

    def __init__(self, original, owner: str) -> None:
        self.original, self.owner = original, owner
        self.agrees: bool | None = None  # None: not yet compared on a real call

    def __call__(self, q, k, cos, sin, *args, **kwargs):
        ops = _ACTIVE.get()
        if ops is None or self.agrees is False or args or kwargs.get("unsqueeze_dim", 1) != 1 \
                or set(kwargs) - {"unsqueeze_dim"}:
            return self.original(q, k, cos, sin, *args, **kwargs)
        fused = ops.rope(q, k, cos, sin)
        if fused is None:
            return self.original(q, k, cos, sin, *args, **kwargs)
        if self.agrees is None:
            want = self.original(q, k, cos, sin, *args, **kwargs)
            self.agrees = all(isinstance(w, torch.Tensor) and same_values(g, w)
                              for w, g in zip(want, fused, strict=True))
            return want
        return fused


def install_rope(model: nn.Module) -> list[RopeDispatch]:
    """A RopeDispatch in each modeling module whose classes this model uses and that defines
    apply_rotary_pos_emb (installed once per module per process)."""
    found = {}
    for module in model.modules():
        mod = sys.modules.get(type(module).__module__)
        fn = getattr(mod, "apply_rotary_pos_emb", None)
        if mod is None or fn is None or mod.__name__ in found:
            continue
        if not isinstance(fn, RopeDispatch):
            if not callable(fn):
                continue
            fn = RopeDispatch(fn, mod.__name__)
            mod.apply_rotary_pos_emb = fn
        found[mod.__name__] = fn
    return list(found.values())


def describe_rope(dispatchers: list[RopeDispatch]) -> str:
    """After the load-time probe forward: which rotary path the model runs."""
    used = [d for d in dispatchers if d.agrees is not None]
    if not used:
        return "torch's own (the model does not call apply_rotary_pos_emb)"
    if all(d.agrees for d in used):
        return "fused (" + ", ".join(d.owner.rsplit(".", 1)[-1] for d in used) + ")"
    return ("torch's own (the fused rotate-half form gave other values than "
            + ", ".join(f"{d.owner}.apply_rotary_pos_emb" for d in used if not d.agrees) + ")")


def _norm_eps(module: nn.Module) -> float | None:
    w = getattr(module, "weight", None)
    if isinstance(module, DistributedRMSNorm):  # its mean square is all-reduced across ranks
        return None
    if not (type(module).__name__.endswith("RMSNorm") and isinstance(w, torch.Tensor)
            and w.dim() == 1 and w.dtype in DTYPES and w.device.type == "cpu"):
        return None
    for attr in ("variance_epsilon", "eps"):
        eps = getattr(module, attr, None)
        if isinstance(eps, float):
            return eps
    return None


def _is_silu_mlp(module: nn.Module) -> bool:
    act = getattr(module, "act_fn", None)
    return (all(isinstance(getattr(module, a, None), nn.Module)
                for a in ("gate_proj", "up_proj", "down_proj"))
            and type(act).__name__ in ("SiLU", "SiLUActivation"))


def same_values(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal up to the dtype's rounding: float32 to 1e-5; bfloat16 at most one bf16 step
    apart, and in at most 1% of the elements (a norm's mean square summed in another order
    moves a rare rounding). Rounding once where the model rounds twice differs in about a
    quarter of them, so this tells rounding variants apart."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if got.dtype != torch.bfloat16:
        return torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    diff = (got.float() - want.float()).abs()
    step = want.float().abs() * 2.0 ** -7 + 1e-30
    return bool((diff <= step).all()) and (diff > 0).float().mean().item() <= 0.01


def _agree(orig: nn.Module, new: nn.Module, width: int, dtype: torch.dtype) -> bool:
    x = torch.randn(1, 5, width, generator=torch.Generator().manual_seed(0)).to(dtype)
    with torch.no_grad():
        want, got = orig(x), new(x)
    return isinstance(want, torch.Tensor) and same_values(got, want)


def load() -> tuple[FusedOps | None, str]:
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None, f"{DISABLE_ENV}=0"
    try:
        return FusedOps(c_build.load(SOURCE)), ""
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return None, str(exc)


@dataclass
class Fused:
    """What fuse() did to a model: the ops to make active around its forwards, the counts of
    swapped modules, the rotary dispatchers, and a line for the log."""

    ops: FusedOps | None = None
    norms: int = 0
    mlps: int = 0
    rope: list[RopeDispatch] = field(default_factory=list)
    how: str = "torch's own ops"


# (w_offset, round_twice), tried in this order: Llama's w * bf16(x_hat); Gemma's one rounding of
# (1 + w) * x_hat; OLMo-2's one rounding of w * x_hat; (1 + w) * bf16(x_hat). float32 rounds
# nothing, so there the first two tell w from 1 + w.
NORM_VARIANTS = ((0.0, True), (1.0, False), (0.0, False), (1.0, True))


def fuse(model: nn.Module) -> Fused:
    """Swap the model's provably equal norms and MLPs in place and put a RopeDispatch in front
    of its rotary function (checked on the first forward run under `active(ops)`)."""
    ops, why = load()
    if ops is None:
        return Fused(how=f"torch's own ops ({why})")
    norms, mlps, kept = 0, 0, set()
    # The model's dtype (packed linear layers hold no weight Parameter to ask).
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new = None
            eps = _norm_eps(child)
            if eps is not None:
                width = child.weight.shape[0]
                new = next((n for n in (FusedRMSNorm(child, ops, off, eps, twice)
                                        for off, twice in NORM_VARIANTS)
                            if _agree(child, n, width, child.weight.dtype)), None)
            elif _is_silu_mlp(child):
                width = getattr(child.gate_proj, "in_features", None)
                cand = FusedSiluMLP(child)
                new = (cand if width and dtype in DTYPES and _agree(child, cand, width, dtype)
                       else None)
            else:
                continue
            if new is None:
                kept.add(type(child).__name__)
                continue
            setattr(parent, name, new)
            if isinstance(new, FusedRMSNorm):
                norms += 1
            else:
                mlps += 1
    note = f"; kept as they are (the probe disagreed): {', '.join(sorted(kept))}" if kept else ""
    return Fused(ops, norms, mlps, install_rope(model),
                 f"fused RMSNorm ({norms}) and SiLU-gated MLP ({mlps}) layers{note}")
