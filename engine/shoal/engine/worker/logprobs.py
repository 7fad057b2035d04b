"""Logprobs of chosen tokens and their top-N alternatives, computed only for rows that asked.

Values are the float32 log_softmax of the model's raw logits: vLLM's default logprobs_mode
(`raw_logprobs`), taken before min-tokens bans, penalties, temperature and top-k/top-p/min-p. So
they describe the model's distribution, whatever the request's sampling settings.

The rank of a chosen token is vLLM's: the number of vocabulary entries whose logprob is at least
its own (1 = the most likely; ties share the worse rank). The sampler's hot path never comes
here: a batch where no row asked computes nothing more than before.
"""

from __future__ import annotations

import torch
from shoal.engine import wire


def raw_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """[R, V] logits -> float32 log_softmax. A new tensor: the sampler may edit `logits` after."""
    return logits.float().log_softmax(dim=-1)


def _columns(logprobs: torch.Tensor, chosen: torch.Tensor, num_top: int):
    """(ids [R, 1+num_top], logprobs [R, 1+num_top], ranks [R]) as little-endian numpy."""
    chosen = chosen.to(torch.long).view(-1, 1)
    chosen_lp = logprobs.gather(1, chosen)
    ranks = (logprobs >= chosen_lp).sum(dim=-1)
    ids, lps = chosen, chosen_lp
    if num_top:
        top_lp, top_ids = torch.topk(logprobs, num_top, dim=-1)
        ids, lps = torch.cat([chosen, top_ids], 1), torch.cat([chosen_lp, top_lp], 1)
    return (ids.cpu().numpy().astype("<i4"), lps.cpu().numpy().astype("<f4"),
            ranks.cpu().numpy().astype("<i4"))


def pack_block(logprobs: torch.Tensor, chosen: torch.Tensor, num_top: int) -> wire.Logprobs:
    """Consecutive positions of ONE request: float32 logprobs [R, V], chosen tokens [R]."""
    ids, lps, ranks = _columns(logprobs, chosen, num_top)
    return wire.Logprobs(num_top, ids.tobytes(), lps.tobytes(), ranks.tobytes())


def pack_rows(logprobs: torch.Tensor, chosen: torch.Tensor,
              num_tops: list[int]) -> list[wire.Logprobs]:
    """One position for each of R requests, row r with its own N = num_tops[r]: one topk for
    the batch (the largest N), each row cut to its own width."""
    ids, lps, ranks = _columns(logprobs, chosen, max(num_tops))
    return [wire.Logprobs(n, ids[r, :1 + n].tobytes(), lps[r, :1 + n].tobytes(),
                          ranks[r:r + 1].tobytes())
            for r, n in enumerate(num_tops)]


def concat(parts: list[wire.Logprobs]) -> wire.Logprobs:
    """Consecutive positions of one request (the chunks of a prompt) as one wire.Logprobs."""
    if len(parts) == 1:
        return parts[0]
    return wire.Logprobs(parts[0].num_top, b"".join(p.token_ids for p in parts),
                         b"".join(p.logprobs for p in parts), b"".join(p.ranks for p in parts))
