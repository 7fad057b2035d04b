"""Tensor parallelism inside transformers' own model classes, vLLM-style, sharded in place.

Every rank loads the full checkpoint, then keeps only its share of each decoder layer:
- attention: q/k/v projections are column-parallel by heads (rank r keeps query heads
  [r*Hq/T, (r+1)*Hq/T) and the KV heads they read). With more ranks than KV heads (T > Hkv) the
  KV heads are replicated, as vLLM does: rank r keeps KV head r // (T // Hkv). o_proj is
  row-parallel: a local matmul, an all-reduce (SUM), then its bias once;
- MLP: gate/up column-parallel, down row-parallel + all-reduce;
- fused projections (Phi-3's qkv_proj, gate_up_proj) are split into their parts, each part
  sharded, and the local parts concatenated again, so transformers' own slicing still works;
- norms over one head (Qwen3's q_norm/k_norm) are unchanged; OLMo-2's q_norm/k_norm over the
  whole projected width become a distributed RMSNorm (all-reduce of the sum of squares);
- embeddings, final norm and LM head stay replicated: every rank computes identical full
  logits, so every rank samples the same token without a gather.

Attention modules get a shallow copy of the config with the local head counts, because some
forwards (Phi-3) slice by `config.num_attention_heads`. Anything this module does not recognise
(extra parameters in a layer, MoE experts, other full-width norms) is refused with a ValueError:
a model is sharded exactly or not at all.

torch.distributed must be initialised by the caller; its default group is the TP group.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from shoal.engine.errors import UnsupportedModelError
from torch import nn

# Full-width q/k norms whose forward is exactly `weight * x * rsqrt(mean(x^2) + eps)` in float32:
# these (and only these) become DistributedRMSNorm.
_WIDTH_RMS_NORMS = {"Olmo2RMSNorm", "Olmo3RMSNorm"}
_ATTN_PARTS = {"q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "q_norm", "k_norm"}
_MLP_PARTS = {"gate_proj", "up_proj", "gate_up_proj", "down_proj"}


def _head_counts(text_cfg) -> tuple[int, int]:
    heads = text_cfg.num_attention_heads
    return heads, getattr(text_cfg, "num_key_value_heads", None) or heads


def check_shardable(text_cfg, world_size: int, model_name: str) -> None:
    """Refuse, before any weight is loaded, a T that does not split the heads or the MLP."""
    heads, kv_heads = _head_counts(text_cfg)
    if heads % world_size:
        raise UnsupportedModelError(f"tensor_parallel_size {world_size} does not divide the "
                         f"{heads} attention heads of {model_name}; choose a divisor of {heads}.")
    if kv_heads % world_size and world_size % kv_heads:
        raise UnsupportedModelError(
            f"tensor_parallel_size {world_size} and the {kv_heads} KV heads of "
            f"{model_name} do not divide one another (KV heads are split when T "
            "divides them and replicated when they divide T).")
    inter = getattr(text_cfg, "intermediate_size", None)
    if isinstance(inter, int) and inter % world_size:
        raise UnsupportedModelError(f"tensor_parallel_size {world_size} does not divide the MLP "
                         f"intermediate_size {inter} of {model_name}.")


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local @ W_local^T) + b: the bias is added once, after the reduce.

    The local matmul is a plain bias-free nn.Linear (`local`), so whatever runs the model's other
    linear layers (cpu/linear.py's packed path) runs this one too."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.local = nn.Linear(self.in_features, self.out_features, bias=False, device="meta")
        self.local.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.local(x)
        dist.all_reduce(y)
        return y if self.bias is None else y + self.bias


class DistributedRMSNorm(nn.Module):
    """RMSNorm over a width split across ranks: the mean square is all-reduced.

    The divisor is local width * T, which is the full width when heads are split and the full
    width times the replication factor when KV heads are replicated (each replica adds its
    head's squares once per copy), so both cases give the unsharded mean."""

    def __init__(self, weight: torch.Tensor, eps: float, world_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.variance_epsilon = eps
        self.world_size = world_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        sq = x.pow(2).sum(-1, keepdim=True)
        dist.all_reduce(sq)
        x = x * torch.rsqrt(sq / (x.shape[-1] * self.world_size) + self.variance_epsilon)
        return (self.weight * x).to(dtype)


def _refuse(model_name: str, why: str) -> None:
    raise UnsupportedModelError(f"cannot shard {model_name} for tensor parallelism: {why}")


def _linear(module: nn.Module, name: str, model_name: str) -> nn.Linear:
    lin = getattr(module, name)
    if type(lin) is not nn.Linear:
        _refuse(model_name, f"{type(module).__name__}.{name} is {type(lin).__name__}, "
                            "not a plain nn.Linear")
    return lin


def _set_columns(lin: nn.Linear, rows: list[slice]) -> None:
    """Keep only these output rows (concatenated) of a linear layer's weight and bias."""
    with torch.no_grad():
        lin.weight = nn.Parameter(torch.cat([lin.weight[s] for s in rows]).contiguous(),
                                  requires_grad=False)
        if lin.bias is not None:
            lin.bias = nn.Parameter(torch.cat([lin.bias[s] for s in rows]).contiguous(),
                                    requires_grad=False)
    lin.out_features = lin.weight.shape[0]


def _row_parallel(lin: nn.Linear, cols: slice) -> RowParallelLinear:
    with torch.no_grad():
        bias = None if lin.bias is None else lin.bias.detach().clone()
        return RowParallelLinear(lin.weight[:, cols].contiguous(), bias)


def _check_parts(module: nn.Module, allowed: set[str], model_name: str) -> None:
    """Refuse a module holding parameters this file does not know how to split."""
    unknown = sorted({n.split(".")[0] for n, _ in module.named_parameters()} - allowed)
    if unknown:
        _refuse(model_name, f"{type(module).__name__} has parameters {unknown} that shoal "
                            "does not know how to split")


class _Plan:
    """Row slices of one rank: query heads, KV heads, MLP columns."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, rank: int, world: int):
        self.hq, self.hkv = heads // world, max(1, kv_heads // world)
        kv_first = rank * self.hkv if kv_heads >= world else rank // (world // kv_heads)
        self.q = slice(rank * self.hq * head_dim, (rank + 1) * self.hq * head_dim)
        self.kv = slice(kv_first * head_dim, (kv_first + self.hkv) * head_dim)
        self.head_dim, self.rank, self.world = head_dim, rank, world

    def mlp(self, inter: int) -> slice:
        share = inter // self.world
        return slice(self.rank * share, (self.rank + 1) * share)


def _is_width_norm(attn: nn.Module, name: str, head_dim: int, full: int, model_name: str) -> bool:
    """True for a norm over the whole projected width (it must be distributed), False for none
    or one per head (Qwen3: each rank's heads normalise themselves); refuses anything else."""
    norm = getattr(attn, name, None)
    if norm is None or norm.weight.numel() == head_dim:
        return False
    if type(norm).__name__ not in _WIDTH_RMS_NORMS or norm.weight.numel() != full:
        _refuse(model_name, f"{type(attn).__name__}.{name} ({type(norm).__name__}, width "
                            f"{norm.weight.numel()}) normalises across heads in a way shoal "
                            "cannot distribute")
    return True


def _check_attention(attn: nn.Module, heads: int, kv_heads: int, model_name: str) -> None:
    _check_parts(attn, _ATTN_PARTS, model_name)
    head_dim = attn.head_dim
    _is_width_norm(attn, "q_norm", head_dim, heads * head_dim, model_name)
    _is_width_norm(attn, "k_norm", head_dim, kv_heads * head_dim, model_name)


def _shard_norm(attn: nn.Module, name: str, full: int, rows: slice, plan: _Plan,
                model_name: str) -> None:
    if not _is_width_norm(attn, name, plan.head_dim, full, model_name):
        return
    norm = getattr(attn, name)
    with torch.no_grad():
        weight = norm.weight[rows].contiguous()
    setattr(attn, name, DistributedRMSNorm(weight, norm.variance_epsilon, plan.world))


def _shard_attention(attn: nn.Module, heads: int, kv_heads: int, rank: int, world: int,
                     model_name: str) -> None:
    head_dim = attn.head_dim
    plan = _Plan(heads, kv_heads, head_dim, rank, world)
    q_width, kv_width = heads * head_dim, kv_heads * head_dim
    if hasattr(attn, "qkv_proj"):
        qkv = _linear(attn, "qkv_proj", model_name)
        if qkv.out_features != q_width + 2 * kv_width:
            _refuse(model_name, f"fused qkv_proj width {qkv.out_features} is not "
                                f"{heads}+2*{kv_heads} heads of {head_dim}")
        k0, v0 = q_width, q_width + kv_width
        _set_columns(qkv, [plan.q, slice(k0 + plan.kv.start, k0 + plan.kv.stop),
                           slice(v0 + plan.kv.start, v0 + plan.kv.stop)])
    else:
        for name, width, rows in (("q_proj", q_width, plan.q), ("k_proj", kv_width, plan.kv),
                                  ("v_proj", kv_width, plan.kv)):
            lin = _linear(attn, name, model_name)
            if lin.out_features != width:
                _refuse(model_name, f"{name} width {lin.out_features} is not "
                                    f"{width // head_dim} heads of {head_dim}")
            _set_columns(lin, [rows])
    _shard_norm(attn, "q_norm", q_width, plan.q, plan, model_name)
    _shard_norm(attn, "k_norm", kv_width, plan.kv, plan, model_name)
    attn.o_proj = _row_parallel(_linear(attn, "o_proj", model_name), plan.q)
    # Shape attributes some forwards read (Phi-3 slices qkv by config.num_attention_heads).
    local_cfg = copy.copy(attn.config)
    local_cfg.num_attention_heads, local_cfg.num_key_value_heads = plan.hq, plan.hkv
    attn.config = local_cfg
    attn.num_key_value_groups = plan.hq // plan.hkv
    for name, value in (("num_heads", plan.hq), ("num_attention_heads", plan.hq),
                        ("num_key_value_heads", plan.hkv)):
        if hasattr(attn, name):
            setattr(attn, name, value)


def _shard_mlp(mlp: nn.Module, rank: int, world: int, model_name: str) -> None:
    _check_parts(mlp, _MLP_PARTS, model_name)
    plan = _Plan(1, 1, 1, rank, world)
    down = _linear(mlp, "down_proj", model_name)
    inter = down.in_features
    if inter % world:
        _refuse(model_name, f"tensor_parallel_size {world} does not divide the MLP width {inter}")
    cols = plan.mlp(inter)
    if hasattr(mlp, "gate_up_proj"):
        fused = _linear(mlp, "gate_up_proj", model_name)
        if fused.out_features != 2 * inter:
            _refuse(model_name, f"fused gate_up_proj width {fused.out_features} is not 2*{inter}")
        _set_columns(fused, [cols, slice(inter + cols.start, inter + cols.stop)])
    else:
        for name in ("gate_proj", "up_proj"):
            _set_columns(_linear(mlp, name, model_name), [cols])
    mlp.down_proj = _row_parallel(down, cols)
    if hasattr(mlp, "intermediate_size"):
        mlp.intermediate_size = inter // world


def _decoder_layers(model: nn.Module, model_name: str) -> nn.ModuleList:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        _refuse(model_name, f"{type(model).__name__} has no model.layers list of decoder layers")
    return layers


def shard_model(model: nn.Module, rank: int, world_size: int, model_name: str) -> None:
    """Shard a loaded causal LM in place for rank `rank` of `world_size` (see module doc)."""
    if world_size == 1:
        return
    text_cfg = model.config.get_text_config()
    check_shardable(text_cfg, world_size, model_name)
    heads, kv_heads = _head_counts(text_cfg)
    hidden = text_cfg.hidden_size
    layers = _decoder_layers(model, model_name)
    # Check every layer's structure before touching any, so a refusal leaves the model intact.
    for layer in layers:
        for attr in ("self_attn", "mlp"):
            if not isinstance(getattr(layer, attr, None), nn.Module):
                _refuse(model_name, f"{type(layer).__name__} has no {attr}")
        _check_attention(layer.self_attn, heads, kv_heads, model_name)
        _check_parts(layer.mlp, _MLP_PARTS, model_name)
        for name, param in layer.named_parameters():
            if not name.startswith(("self_attn.", "mlp.")) and tuple(param.shape) != (hidden,):
                _refuse(model_name, f"{type(layer).__name__}.{name} {tuple(param.shape)} is "
                                    "neither attention, MLP nor a hidden-size norm")
    if not dist.is_initialized() or dist.get_world_size() != world_size:
        have = dist.get_world_size() if dist.is_initialized() else "not initialised"
        raise RuntimeError(f"tensor_parallel_size {world_size} needs torch.distributed "
                           f"initialised with that world size before the model is loaded "
                           f"(default group: {have})")
    for layer in layers:
        _shard_attention(layer.self_attn, heads, kv_heads, rank, world_size, model_name)
        _shard_mlp(layer.mlp, rank, world_size, model_name)
