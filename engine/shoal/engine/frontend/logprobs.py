"""The engine's packed logprobs (wire.Logprobs) as per-position records with token strings.

The frontend owns the tokenizer, so token strings are made here: each token id decodes alone,
special tokens included (vLLM's decoded_token); a token that is part of a multi-byte character
decodes to U+FFFD, as in vLLM. Torch-free: the columns are read with `array`.
"""

from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass

from shoal.engine import wire


@dataclass
class PositionLogprobs:
    """One position: the chosen token first, then the top-N alternatives by rank."""

    token_ids: list[int]
    logprobs: list[float]
    tokens: list[str]  # token_ids decoded one by one
    rank: int  # the chosen token's rank (1 = most likely)

    @property
    def token_id(self) -> int:
        return self.token_ids[0]

    @property
    def logprob(self) -> float:
        return self.logprobs[0]

    @property
    def token(self) -> str:
        return self.tokens[0]


def _read(code: str, data: bytes) -> array:
    values = array(code)
    values.frombytes(data)
    if sys.byteorder != "little":
        values.byteswap()
    return values


class TokenStrings:
    """Token id -> its string, cached per tokenizer (the same alternatives recur)."""

    def __init__(self, tokenizer) -> None:
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            if self._backend is not None:
                text = self._backend.decode([token_id], skip_special_tokens=False)
            else:
                text = self._tokenizer.decode([token_id])
            self._cache[token_id] = text
        return text


def unpack(lp: wire.Logprobs, token_string: TokenStrings) -> list[PositionLogprobs]:
    ids = _read("i", lp.token_ids)
    values = _read("f", lp.logprobs)
    ranks = _read("i", lp.ranks)
    width = lp.num_top + 1
    out = []
    for r, rank in enumerate(ranks):
        row_ids = ids[r * width:(r + 1) * width].tolist()
        out.append(PositionLogprobs(row_ids, values[r * width:(r + 1) * width].tolist(),
                                    [token_string(t) for t in row_ids], rank))
    return out
