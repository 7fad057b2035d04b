"""Per-request state the runner keeps between steps, and the sampling metadata built from it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from shoal.engine import wire
from shoal.engine.worker.sampler import SamplingMetadata


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    params: wire.SamplingParams
    eos_token_id: int | None
    generator: torch.Generator | None
    output_token_ids: list[int] = field(default_factory=list)
    lora_request: wire.LoRARequest | None = None  # --enable-lora: the adapter it runs with

    @property
    def has_penalties(self) -> bool:
        p = self.params
        return (p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0
                or p.presence_penalty != 0.0)

    def banned_tokens(self) -> list[int]:
        """Stop tokens that may not be sampled yet because min_tokens is unmet."""
        if len(self.output_token_ids) >= self.params.min_tokens:
            return []
        banned = list(self.params.stop_token_ids)
        if self.eos_token_id is not None and not self.params.ignore_eos:
            banned.append(self.eos_token_id)
        return banned


def build_sampling_metadata(states: list[CachedRequestState], vocab: int,
                            device) -> SamplingMetadata:
    """Vectorise the sampling parameters of the rows being sampled this step."""
    params = [s.params for s in states]
    greedy_list = [p.temperature == 0.0 for p in params]
    all_greedy = all(greedy_list)
    f32 = dict(dtype=torch.float32, device=device)
    temperature = torch.tensor([1.0 if g else p.temperature
                                for g, p in zip(greedy_list, params, strict=True)], **f32)
    top_k = top_p = min_p = None
    if not all_greedy:
        if any(p.top_k > 0 for p in params):
            top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params],
                                 dtype=torch.long, device=device)
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], **f32)
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], **f32)
    meta = SamplingMetadata(
        temperature=temperature,
        greedy=torch.tensor(greedy_list, dtype=torch.bool, device=device),
        all_greedy=all_greedy,
        top_k=top_k, top_p=top_p, min_p=min_p,
        generators={i: s.generator for i, s in enumerate(states)
                    if s.generator is not None and not greedy_list[i]},
    )
    if any(s.has_penalties for s in states):
        meta.output_token_ids = [s.output_token_ids for s in states]
        meta.prompt_token_ids = [s.prompt_token_ids for s in states]
        meta.repetition_penalty = torch.tensor([p.repetition_penalty for p in params], **f32)
        meta.frequency_penalty = torch.tensor([p.frequency_penalty for p in params], **f32)
        meta.presence_penalty = torch.tensor([p.presence_penalty for p in params], **f32)
    rows, toks = [], []
    for i, s in enumerate(states):
        if s.params.min_tokens:
            for t in s.banned_tokens():
                if 0 <= t < vocab:
                    rows.append(i)
                    toks.append(t)
    if rows:
        meta.banned_rows = torch.tensor(rows, dtype=torch.long, device=device)
        meta.banned_tokens = torch.tensor(toks, dtype=torch.long, device=device)
    return meta
