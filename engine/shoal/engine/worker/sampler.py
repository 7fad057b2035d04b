"""Sampling over a batch of logits, vectorised across requests.

Order (vLLM's): stop tokens masked while min_tokens is unmet -> repetition, frequency and
presence penalties -> greedy rows take the argmax -> temperature -> top-k -> top-p -> min-p ->
sample. Sampling uses the exponential trick (argmax of probs / Exp(1) noise), so a seeded
request draws its noise from its own torch.Generator and is reproducible whatever else is in
the batch; unseeded rows share the engine's generator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from shoal.engine.structured.bitmask import apply_bitmask

_NEG_INF = float("-inf")

Argmax = Callable[[torch.Tensor], "torch.Tensor | None"]


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [R] float; greedy rows hold 1.0
    greedy: torch.Tensor  # [R] bool
    all_greedy: bool
    top_k: torch.Tensor | None  # [R] long, vocab size where disabled; None = nobody uses it
    top_p: torch.Tensor | None  # [R] float
    min_p: torch.Tensor | None  # [R] float
    generators: dict[int, torch.Generator]  # row -> the request's own generator (seeded)
    # Penalties (None = no request in the batch uses any):
    output_token_ids: list[list[int]] | None = None
    prompt_token_ids: list[list[int]] | None = None
    repetition_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    presence_penalty: torch.Tensor | None = None
    # Stop tokens banned while a row has fewer than min_tokens outputs: (rows, token ids).
    banned_rows: torch.Tensor | None = None
    banned_tokens: torch.Tensor | None = None


def _token_counts(token_lists: list[list[int]], vocab: int, device) -> torch.Tensor:
    width = max((len(t) for t in token_lists), default=0)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    if width:
        padded = torch.tensor([t + [vocab] * (width - len(t)) for t in token_lists],
                              dtype=torch.long, device=device)
        counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, m: SamplingMetadata) -> torch.Tensor:
    vocab = logits.shape[1]
    out_counts = _token_counts(m.output_token_ids, vocab, logits.device)
    seen = (_token_counts(m.prompt_token_ids, vocab, logits.device) > 0) | (out_counts > 0)
    rep = m.repetition_penalty.unsqueeze(1)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - m.frequency_penalty.unsqueeze(1) * out_counts
    logits = logits - m.presence_penalty.unsqueeze(1) * (out_counts > 0).to(logits.dtype)
    return logits


def _top_k_top_p(logits: torch.Tensor, top_k, top_p) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        ranks = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), _NEG_INF)
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
        drop = before > top_p.unsqueeze(1)
        drop[:, 0] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def greedy(logits: torch.Tensor, argmax: Argmax | None = None) -> torch.Tensor:
    """Each row's first maximum: `argmax` (a faster equal kernel, None where it does not take
    these logits) or torch's max().indices (not argmax(): the same first-maximum index, ~35%
    faster on CPU, 2 vs 3.2 ms for 200 x 8192 float32 logits, one thread)."""
    out = argmax(logits) if argmax is not None else None
    return out if out is not None else logits.max(dim=-1).indices


def sample(logits: torch.Tensor, m: SamplingMetadata, generator: torch.Generator | None = None,
           argmax: Argmax | None = None):
    """Return one token id per row, as a 1-D long tensor. argmax: see greedy()."""
    if m.all_greedy and m.banned_rows is None and m.output_token_ids is None:
        # Nothing edits the logits: the argmax in their own dtype (a bf16 -> float32 copy is
        # exact, so the same index), without a float32 copy of the whole batch's logits.
        return greedy(logits, argmax)
    logits = logits.float()
    if m.banned_rows is not None:
        logits[m.banned_rows, m.banned_tokens] = _NEG_INF
    if m.output_token_ids is not None:
        logits = apply_penalties(logits, m)
    greedy_tokens = greedy(logits, argmax)
    if m.all_greedy:
        return greedy_tokens
    logits = logits / m.temperature.unsqueeze(1)
    if m.top_k is not None or m.top_p is not None:
        logits = _top_k_top_p(logits, m.top_k, m.top_p)
    probs = logits.softmax(dim=-1)
    if m.min_p is not None:
        threshold = probs.amax(dim=-1, keepdim=True) * m.min_p.unsqueeze(1)
        probs = probs.masked_fill(probs < threshold, 0.0)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    for row, gen in m.generators.items():
        noise[row].exponential_(generator=gen)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(m.greedy, greedy_tokens, sampled)


def apply_grammar_bitmask(logits: torch.Tensor, row_req_ids: list[str],
                          grammar_req_ids: list[str], bitmask: bytes) -> None:
    """Structured output, before sampling: disallowed tokens of the constrained rows to -inf
    (in place). `row_req_ids` names the logits' rows; the bitmask has one row per grammar id."""
    row_of = {rid: i for i, rid in enumerate(row_req_ids)}
    apply_bitmask(logits, bitmask, [row_of[rid] for rid in grammar_req_ids])
