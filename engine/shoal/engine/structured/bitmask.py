"""Apply a packed token bitmask to logits: one int32 word per 32 token ids, bit set = allowed.

The bitmask travels in the SchedulerOutput as little-endian bytes, one row per constrained
sampling row; rows that are not constrained are not touched (an unconstrained batch pays
nothing: there is no mask at all)."""

from __future__ import annotations

import torch

_SHIFTS = torch.arange(32, dtype=torch.int32)


def unpack(bitmask: bytes, num_rows: int, vocab_size: int, device) -> torch.Tensor:
    """[num_rows, vocab_size] bool: True where the token is allowed."""
    words = torch.frombuffer(bytearray(bitmask), dtype=torch.int32).view(num_rows, -1)
    bits = (words.unsqueeze(-1) >> _SHIFTS) & 1
    return bits.view(num_rows, -1)[:, :vocab_size].to(device=device, dtype=torch.bool)


def apply_bitmask(logits: torch.Tensor, bitmask: bytes, rows: list[int]) -> None:
    """Set the logits of disallowed tokens to -inf, in place, for the listed rows."""
    allowed = unpack(bitmask, len(rows), logits.shape[1], logits.device)
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
