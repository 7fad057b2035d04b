"""Paged attention plugged into transformers' own models through its attention interface.

transformers' attention layers call `ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`
with (module, query, key, value, mask, scaling, **kwargs). We register "shoal_paged" there and
select it on the loaded model, so the model classes stay transformers' own: projections, RoPE,
norms and MLPs are theirs; only "where K/V live and which keys each query sees" is ours.

The batch is packed: one sequence of shape [1, T] holding every scheduled token of every
request, with per-token positions. Per-step metadata (`PagedAttentionMetadata`, built once and
passed to every layer as the `shoal_attn` keyword) says where each token's K/V goes in the paged
cache (slot mapping) and which cached keys each query attends to (block tables):
- decode rows (one new token) go to the CPU paged-decode kernel (cpu_kernel.py) where it is
  loaded: it reads K/V straight from the blocks. Otherwise they are attended in cache-sized
  groups, gathered, padded to the longest context and masked;
- prefill chunks (several new tokens) are attended one request at a time; a chunk with no
  cached context uses plain causal attention on its own K/V, without touching the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from shoal.engine.worker.cpu_kernel import PagedDecodeKernel
from transformers import AttentionInterface

ATTN_IMPLEMENTATION = "shoal_paged"


@dataclass
class PrefillChunk:
    token_start: int  # index of the chunk's first token in the packed batch
    token_end: int
    block_ids: torch.Tensor | None  # blocks to gather the context from; None = no context
    context_len: int  # tokens of context including this chunk
    mask: torch.Tensor | None  # [q, context] additive 0/-inf, None = plain causal over the chunk


@dataclass
class PagedAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: flat slot (block * block_size + offset) per token
    decode_token_idx: torch.Tensor | None  # [D] rows of the packed batch that are decodes
    decode_block_table: torch.Tensor | None  # [D, nb] long, padded with the null block 0
    decode_mask: torch.Tensor | None  # [D, 1, 1, nb * block_size] additive 0/-inf; torch path
    all_decode: bool  # every token is a decode: no scatter back needed
    prefills: list[PrefillChunk]
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer, [num_blocks, bs, Hkv, D]
    decode_ctx_lens: torch.Tensor | None = None  # [D] long: context of each decode row (kernel)
    decode_kernel: PagedDecodeKernel | None = None  # set: decode rows take the CPU kernel
    # Reused destination of the decode gathers (K, V): every layer gathers the same shape, and
    # writing into warm memory avoids page faults on a fresh allocation per layer.
    gather_buffers: tuple[torch.Tensor, torch.Tensor] | None = None


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, buffer: torch.Tensor | None):
    """Rows of whole blocks, copied as flat rows (several times faster than a 4-D gather)."""
    flat = cache.view(cache.shape[0], -1)
    if buffer is None:
        return flat.index_select(0, block_ids)
    out = buffer[: block_ids.numel()]
    return torch.index_select(flat, 0, block_ids, out=out)


# Decode rows are attended in groups whose gathered K/V (about this many bytes) stay in the CPU
# cache between the gather and the attention that reads them, instead of one batch-wide gather
# that streams through main memory twice.
DECODE_GROUP_BYTES = 1 << 20


def _decode_attention(qd, k_cache, v_cache, meta: PagedAttentionMetadata, scaling):
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if meta.decode_kernel is not None:
        scale = scaling if scaling is not None else head_dim ** -0.5
        out = meta.decode_kernel(qd, k_cache, v_cache, meta.decode_block_table,
                                 meta.decode_ctx_lens, scale)
        if out is None:  # the runner checked the shapes at load time: this is a bug
            raise RuntimeError(f"paged decode kernel refused q {tuple(qd.shape)}, cache "
                               f"{tuple(k_cache.shape)}")
        return out
    rows, width = meta.decode_block_table.shape
    ctx = width * block_size
    # GQA without expanding K/V: the query heads that share a KV head become that head's
    # query rows (one mask row serves them all, since a decode row has one position).
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
        o = F.scaled_dot_product_attention(q[start:end], kd, vd,
                                           attn_mask=meta.decode_mask[start:end], scale=scaling)
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
    shoal_attn: PagedAttentionMetadata | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    if shoal_attn is None:
        raise RuntimeError("shoal_paged attention called without shoal_attn metadata; the "
                           "model must be run through shoal's ModelRunner")
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
        od = _decode_attention(qd, k_cache, v_cache, meta, scaling)  # [D, Hq, hd]
        if meta.all_decode:
            return od.unsqueeze(0), None
        out.index_copy_(0, meta.decode_token_idx, od)
    for chunk in meta.prefills:
        qp = q[chunk.token_start:chunk.token_end].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, hd]
        if chunk.block_ids is None:
            kp = k[chunk.token_start:chunk.token_end]
            vp = v[chunk.token_start:chunk.token_end]
        else:
            ctx_shape = (-1, num_kv_heads, head_dim)
            kp = _gather(k_cache, chunk.block_ids, None).view(ctx_shape)[:chunk.context_len]
            vp = _gather(v_cache, chunk.block_ids, None).view(ctx_shape)[:chunk.context_len]
        op = F.scaled_dot_product_attention(
            qp, kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0),
            attn_mask=chunk.mask, is_causal=chunk.mask is None, scale=scaling, enable_gqa=True,
        )
        out[chunk.token_start:chunk.token_end] = op[0].transpose(0, 1)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
