"""Which models the engine serves, decided by what they use, not by their class name.

At load the runner makes one probe pass: a forward of a few tokens with an `AttentionProbe` as
the attention metadata. paged_attention.py refuses any attention keyword it does not implement;
the probe records, per attention call, the layer, head counts, head size, query/key lengths, the
variant (window, softcap, sinks), whether the model handed attention a mask of its own and
whether the module is causal. `probe_model` then refuses, naming the feature and the model,
anything the paged cache cannot reproduce exactly: layers that never call the attention
interface (recurrent/state-space layers, a forward that computes attention itself), bidirectional
or cross attention, masks or biases built by the model (ALiBi), layer types other than full and
sliding attention, and per-layer head shapes the uniform cache cannot hold. What passes gives
the KV cache its geometry: the heads and head size the layers really produce.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from shoal.engine.errors import UnsupportedModelError
from shoal.engine.worker.paged_attention import UnsupportedAttention, Variant, _additive

PROBE_TOKENS = 3
SERVED_LAYER_TYPES = {"full_attention", "sliding_attention", "sparse", "dense"}


@dataclass
class LayerCall:
    layer_idx: int | None
    module: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    q_len: int
    k_len: int
    variant: Variant
    has_mask: bool
    causal: bool


@dataclass
class AttentionProbe:
    """Stands in for PagedAttentionMetadata during the probe pass; records every call."""

    calls: list[LayerCall] = field(default_factory=list)

    def record(self, module, query, key, mask, var: Variant) -> None:
        self.calls.append(LayerCall(
            getattr(module, "layer_idx", None), type(module).__name__, query.shape[1],
            key.shape[1], query.shape[3], query.shape[2], key.shape[2], var,
            mask is not None, bool(getattr(module, "is_causal", True))))

    def mask(self, n: int, window: int | None, dtype: torch.dtype, device) -> torch.Tensor:
        pos = torch.arange(n, device=device)
        visible = pos[None, :] <= pos[:, None]
        if window:
            visible &= pos[None, :] > pos[:, None] - window
        return _additive(visible, dtype)


@dataclass
class AttentionLayout:
    """What the probe found: the KV cache's geometry and the variants in use."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    windows: list[int | None]  # per layer
    softcap: bool
    sinks: bool

    def describe(self) -> str:
        parts = [f"{self.num_layers} layers", f"{self.num_heads} query / {self.num_kv_heads} KV "
                 f"heads of {self.head_dim}"]
        sliding = sorted({w for w in self.windows if w})
        if sliding:
            parts.append(f"sliding window {sliding} on "
                         f"{sum(1 for w in self.windows if w)} layers")
        parts += [name for name, on in (("softcap", self.softcap), ("sinks", self.sinks)) if on]
        return ", ".join(parts)


def check_config(text_cfg, name: str) -> None:
    """Refuse features that live in the config (and in masks a custom attention never gets)."""
    def refuse(feature: str) -> None:
        raise UnsupportedModelError(f"{name} uses {feature}, which shoal does not implement; "
                                    "refusing to serve it rather than answer wrongly")

    odd = sorted(set(getattr(text_cfg, "layer_types", None) or ()) - SERVED_LAYER_TYPES)
    if odd:
        refuse(f"layer types {odd} (shoal serves full_attention and sliding_attention layers)")
    if getattr(text_cfg, "attention_chunk_size", None):
        refuse(f"chunked attention (attention_chunk_size={text_cfg.attention_chunk_size})")
    if getattr(text_cfg, "use_bidirectional_attention", False):
        refuse("bidirectional attention (use_bidirectional_attention)")


def probe_model(model, text_cfg, device: torch.device, name: str) -> AttentionLayout:
    """One forward of PROBE_TOKENS tokens, called as ModelRunner calls it; the layout, or a
    UnsupportedModelError naming what the model uses that the engine does not implement."""
    probe = AttentionProbe()
    ids = torch.arange(PROBE_TOKENS, device=device)[None] % text_cfg.vocab_size
    try:
        with torch.inference_mode():
            model(input_ids=ids, position_ids=torch.arange(PROBE_TOKENS, device=device)[None],
                  logits_to_keep=1, shoal_attn=probe, use_cache=False)
    except UnsupportedAttention as exc:
        raise UnsupportedModelError(
            f"{name}: {exc}; refusing to serve it rather than answer wrongly") from None
    return _layout(probe.calls, text_cfg, name)


def _layout(calls: list[LayerCall], text_cfg, name: str) -> AttentionLayout:
    def refuse(why: str) -> None:
        raise UnsupportedModelError(f"{name}: {why}; shoal's paged attention cannot serve it "
                                    "exactly, so it refuses it")

    layers = text_cfg.num_hidden_layers
    if not calls:
        refuse("its transformers implementation does not route attention through "
               "AttentionInterface, so the paged KV cache cannot be plugged in")
    for c in calls:
        if c.has_mask:
            refuse(f"{c.module} receives an attention mask or bias the model builds itself "
                   "(e.g. ALiBi)")
        if not c.causal:
            refuse(f"{c.module} is bidirectional (not causal)")
        if c.q_len != PROBE_TOKENS or c.k_len != PROBE_TOKENS:
            refuse(f"{c.module} attends {c.k_len} keys for {c.q_len} queries (cross-attention "
                   "or shared KV), not its own tokens")
    seen = sorted(c.layer_idx for c in calls if c.layer_idx is not None)
    if len(seen) != len(calls) or seen != list(range(layers)):
        missing = sorted(set(range(layers)) - set(seen))
        refuse(f"attention layers called {seen} of {layers} (missing {missing}: layers without "
               "attention, e.g. recurrent or state-space, keep state the paged cache does not "
               "hold)")
    shapes = {(c.num_heads, c.num_kv_heads, c.head_dim) for c in calls}
    if len(shapes) > 1:
        refuse(f"layers differ in (query heads, KV heads, head size): {sorted(shapes)}")
    (num_heads, num_kv_heads, head_dim), = shapes
    calls = sorted(calls, key=lambda c: c.layer_idx)
    windows = [c.variant.window for c in calls]
    # transformers' own masks follow layer_types; the paged path follows the keyword: they agree.
    types = getattr(text_cfg, "layer_types", None)
    for c, kind in zip(calls, types or (), strict=False):
        expected = getattr(text_cfg, "sliding_window", None) if kind == "sliding_attention" \
            else None
        if c.variant.window != expected:
            refuse(f"layer {c.layer_idx} is a {kind} layer but its attention is called with "
                   f"sliding_window={c.variant.window}")
    return AttentionLayout(layers, num_heads, num_kv_heads, head_dim, windows,
                           any(c.variant.softcap is not None for c in calls),
                           any(c.variant.sinks is not None for c in calls))
