"""Paged attention plugged into transformers' own models through its attention interface.

transformers' attention layers call `ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`
with (module, query, key, value, mask, scaling, **kwargs). We register "shoal_paged" there and
select it on the loaded model, so the model classes stay transformers' own: projections, RoPE,
norms and MLPs are theirs (on the CPU, cpu/linear.py and cpu/fused.py run checked equivalents);
only "where K/V live and which keys each query sees" is ours.

The batch is packed: one sequence of shape [1, T] holding every scheduled token of every
request, with per-token positions. Per-step metadata (`PagedAttentionMetadata`, built once and
passed to every layer as the `shoal_attn` keyword) says where each token's K/V goes in the paged
cache (slot mapping) and which cached keys each query attends to (block tables):
- decode rows (one new token) go to the CPU paged-decode kernel (cpu/decode_kernel.py) where it is
  loaded: it reads K/V straight from the blocks. Otherwise they are attended in cache-sized
  groups, gathered, padded to the longest context and masked;
- prefill chunks (several new tokens) are attended one request at a time; a chunk with no
  cached context uses plain causal attention on its own K/V, without touching the cache.

The per-layer variants transformers' models pass as keywords are implemented, with the models'
own (eager) semantics: `sliding_window` (a query sees its last W keys, itself included: Mistral,
Gemma-2/3, Qwen2/3 sliding layers, gpt-oss), `softcap` (Gemma-2's tanh soft-capping of the
scores) and `s_aux` (gpt-oss's per-head attention sinks). Windows are masks, so blocks behind a
window stay cached and prefix caching and chunked prefill work unchanged. SDPA has no softcap or
sinks: layers with them are attended with explicit matmul/softmax on the torch path; the CPU
kernel does all three. Any other keyword is refused (`UnsupportedAttention`): the model runner
makes one probe pass at load (model_check.py), so a model asking for something else is refused
at start-up, not answered wrongly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

if TYPE_CHECKING:
    from shoal.engine.worker.cpu.decode_kernel import PagedDecodeKernel

ATTN_IMPLEMENTATION = "shoal_paged"
# Keywords transformers' layers pass that this function implements.
IMPLEMENTED = {"sliding_window", "softcap", "s_aux", "is_causal"}
# Keywords that carry nothing attention must act on here (positions are already in the RoPE'd
# q/k; the rest are model-level flags). Any other keyword that is not None is refused.
IGNORED = {"position_ids", "cache_position", "use_cache", "output_attentions",
           "output_router_logits", "output_hidden_states", "return_dict"}


class UnsupportedAttention(ValueError):
    """A model asked the attention function for something it does not implement."""


@dataclass
class PrefillChunk:
    token_start: int  # index of the chunk's first token in the packed batch
    token_end: int
    block_ids: torch.Tensor | None  # blocks to gather the context from; None = no context
    context_len: int  # tokens of context including this chunk


@dataclass
class PagedAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: flat slot (block * block_size + offset) per token
    decode_token_idx: torch.Tensor | None  # [D] rows of the packed batch that are decodes
    decode_block_table: torch.Tensor | None  # [D, nb] long, padded with the null block 0
    decode_ctx_lens: torch.Tensor | None  # [D] long: context of each decode row
    all_decode: bool  # every token is a decode: no scatter back needed
    prefills: list[PrefillChunk]
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer, [num_blocks, bs, Hkv, D]
    decode_kernel: PagedDecodeKernel | None = None  # set: decode rows take the CPU kernel
    # Reused destination of the decode gathers (K, V): every layer gathers the same shape, and
    # writing into warm memory avoids page faults on a fresh allocation per layer.
    gather_buffers: tuple[torch.Tensor, torch.Tensor] | None = None
    # Additive masks built on first use by a layer and shared by the layers with the same window.
    masks: dict = field(default_factory=dict)

    def decode_mask(self, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """[D, 1, 1, nb * block_size] additive 0/-inf: the keys each decode row sees."""
        key = ("decode", window)
        if key not in self.masks:
            bs = self.kv_caches[0][0].shape[1]
            width = self.decode_block_table.shape[1] * bs
            keys = torch.arange(width, device=self.slot_mapping.device)
            ctx = self.decode_ctx_lens.unsqueeze(1)
            visible = keys.unsqueeze(0) < ctx
            if window:
                visible &= keys.unsqueeze(0) >= ctx - window
            self.masks[key] = _additive(visible, dtype)[:, None, None, :]
        return self.masks[key]

    def prefill_mask(self, i: int, window: int | None, dtype: torch.dtype) -> torch.Tensor | None:
        """[q, context] additive 0/-inf for prefill chunk i; None = plain causal over the chunk."""
        chunk = self.prefills[i]
        n = chunk.token_end - chunk.token_start
        if chunk.block_ids is None and (not window or n <= window):
            return None
        key = ("prefill", i, window)
        if key not in self.masks:
            dev = self.slot_mapping.device
            q_pos = (chunk.context_len - n + torch.arange(n, device=dev)).unsqueeze(1)
            keys = torch.arange(chunk.context_len, device=dev).unsqueeze(0)
            visible = keys <= q_pos
            if window:
                visible &= keys > q_pos - window
            self.masks[key] = _additive(visible, dtype)
        return self.masks[key]


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive float masks: the CPU SDPA kernels are several times faster with them than bool."""
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill_(~visible, float("-inf"))


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, buffer: torch.Tensor | None):
    """Rows of whole blocks, copied as flat rows (several times faster than a 4-D gather)."""
    flat = cache.view(cache.shape[0], -1)
    if buffer is None:
        return flat.index_select(0, block_ids)
    out = buffer[: block_ids.numel()]
    return torch.index_select(flat, 0, block_ids, out=out)


@dataclass
class Variant:
    """The per-layer attention variant a model asked for (None = not used)."""

    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None  # [Hq]

    @property
    def needs_eager(self) -> bool:  # SDPA has neither
        return self.softcap is not None or self.sinks is not None


def variant_of(module: torch.nn.Module, kwargs: dict) -> Variant:
    """The keywords this function implements, or UnsupportedAttention naming any other."""
    extra = [k for k in kwargs.keys() - IMPLEMENTED - IGNORED if kwargs[k] is not None]
    if extra:
        raise UnsupportedAttention(
            f"{type(module).__name__} asks attention for {sorted(extra)}, which shoal's paged "
            f"attention does not implement (it implements {sorted(IMPLEMENTED - {'is_causal'})})")
    if kwargs.get("is_causal", True) is False:
        raise UnsupportedAttention(f"{type(module).__name__} asks for bidirectional attention "
                                   "(is_causal=False); shoal's paged attention is causal")
    window = kwargs.get("sliding_window")
    return Variant(window if window and window > 0 else None, kwargs.get("softcap") or None,
                   kwargs.get("s_aux"))


def _eager(q, k, v, mask, scale, var: Variant, causal: bool):
    """Attention as transformers' eager functions compute it, with softcap and sinks.

    q [B, Hq, n, D]; k, v [B, Hkv, L, D]; mask additive, broadcastable to [B, Hq, n, L]."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if var.softcap is not None:
        scores = torch.tanh(scores / var.softcap) * var.softcap
    if mask is None and causal:
        n = q.shape[2]
        mask = _additive(torch.ones(n, n, dtype=torch.bool, device=q.device).tril(), q.dtype)
    if mask is not None:
        scores = scores + mask
    if var.sinks is not None:
        sink = var.sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(scores.float(), dim=-1)
    if var.sinks is not None:
        probs = probs[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


def _attend(q, k, v, mask, scale, var: Variant, causal: bool = False):
    if var.needs_eager:
        return _eager(q, k, v, mask, scale, var, causal)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                          is_causal=causal and mask is None, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


# Decode rows are attended in groups whose gathered K/V (about this many bytes) stay in the CPU
# cache between the gather and the attention that reads them, instead of one batch-wide gather
# that streams through main memory twice.
DECODE_GROUP_BYTES = 1 << 20


def _decode_attention(qd, k_cache, v_cache, meta: PagedAttentionMetadata, scale, var: Variant):
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if meta.decode_kernel is not None:
        out = meta.decode_kernel(qd, k_cache, v_cache, meta.decode_block_table,
                                 meta.decode_ctx_lens, scale, var.window, var.softcap, var.sinks)
        if out is None:  # the runner checked the shapes at load time: this is a bug
            raise RuntimeError(f"paged decode kernel refused q {tuple(qd.shape)}, cache "
                               f"{tuple(k_cache.shape)}")
        return out
    rows, width = meta.decode_block_table.shape
    ctx = width * block_size
    mask = meta.decode_mask(var.window, qd.dtype)
    # GQA without expanding K/V: the query heads that share a KV head become that head's
    # query rows (one mask row serves them all, since a decode row has one position). The eager
    # path (softcap, sinks) keeps one query row per head instead, as its sinks are per head.
    if var.needs_eager:
        q = qd.reshape(rows, -1, 1, head_dim)
    else:
        q = qd.reshape(rows, num_kv_heads, -1, head_dim)
    row_bytes = 2 * ctx * num_kv_heads * head_dim * k_cache.element_size()
    group = rows if k_cache.is_cuda else max(1, DECODE_GROUP_BYTES // row_bytes)
    out = q.new_empty(q.shape) if group < rows else None
    kbuf, vbuf = meta.gather_buffers
    for start in range(0, rows, group):
        end = min(start + group, rows)
        ids = meta.decode_block_table[start:end].reshape(-1)
        shape = (end - start, ctx, num_kv_heads, head_dim)
        kd = _gather(k_cache, ids, kbuf).view(shape).transpose(1, 2)  # [n, Hkv, L, hd]
        vd = _gather(v_cache, ids, vbuf).view(shape).transpose(1, 2)
        o = _attend(q[start:end], kd, vd, mask[start:end], scale, var)
        if out is None:
            return o.reshape(rows, -1, head_dim)
        out[start:end] = o
    return out.reshape(rows, -1, head_dim)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, Hq, T, D]
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    shoal_attn=None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    if shoal_attn is None:
        raise RuntimeError("shoal_paged attention called without shoal_attn metadata; the "
                           "model must be run through shoal's ModelRunner")
    var = variant_of(module, kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if not isinstance(shoal_attn, PagedAttentionMetadata):  # the load-time probe
        shoal_attn.record(module, query, key, attention_mask, var)
        mask = shoal_attn.mask(query.shape[2], var.window, query.dtype, query.device)
        out = _attend(query, key, value, mask, scale, var)
        return out.transpose(1, 2), None
    meta = shoal_attn
    k_cache, v_cache = meta.kv_caches[module.layer_idx]
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    q = query[0].transpose(0, 1)  # [T, Hq, D]
    k = key[0].transpose(0, 1)  # [T, Hkv, D]
    v = value[0].transpose(0, 1)
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)

    out = q.new_empty(q.shape) if not meta.all_decode else None
    if meta.decode_token_idx is not None:
        qd = q if meta.all_decode else q.index_select(0, meta.decode_token_idx)
        od = _decode_attention(qd, k_cache, v_cache, meta, scale, var)  # [D, Hq, hd]
        if meta.all_decode:
            return od.unsqueeze(0), None
        out.index_copy_(0, meta.decode_token_idx, od)
    for i, chunk in enumerate(meta.prefills):
        qp = q[chunk.token_start:chunk.token_end].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, hd]
        if chunk.block_ids is None:
            kp = k[chunk.token_start:chunk.token_end]
            vp = v[chunk.token_start:chunk.token_end]
        else:
            ctx_shape = (-1, num_kv_heads, head_dim)
            kp = _gather(k_cache, chunk.block_ids, None).view(ctx_shape)[:chunk.context_len]
            vp = _gather(v_cache, chunk.block_ids, None).view(ctx_shape)[:chunk.context_len]
        op = _attend(qp, kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0),
                     meta.prefill_mask(i, var.window, q.dtype), scale, var, causal=True)
        out[chunk.token_start:chunk.token_end] = op[0].transpose(0, 1)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
