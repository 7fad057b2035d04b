"""Logprobs in the response shapes OpenAI's clients parse, as vLLM fills them.

- Completions (OpenAI's legacy shape): `{tokens, token_logprobs, top_logprobs, text_offset}`;
  each top_logprobs entry is a dict token string -> logprob holding the sampled token and the N
  most likely (up to N+1 entries, as OpenAI documents); a position without logprobs (the first
  echoed prompt token) is null in token_logprobs and top_logprobs.
- Chat: `{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`; the
  top_logprobs are the N most likely tokens, most likely first.
- vLLM's prompt_logprobs: `[null, {"<token id>": {logprob, rank, decoded_token}}, ...]`, each
  dict the prompt token and the N most likely.

Logprobs below -9999 (-inf included: JSON has no infinity) are sent as -9999.0, OpenAI's
"very unlikely" value, as vLLM does.

`as_ids` (vLLM's --return-tokens-as-token-ids, or the request's return_tokens_as_token_ids):
every token string is `token_id:{id}` (vLLM's format_token_id_placeholder), so tokens that are
not valid UTF-8 on their own can be told apart; as in vLLM, completions' text_offset then counts
those strings, and a chat position's own `bytes` stay its decoded text's.
"""

from __future__ import annotations

from collections.abc import Callable

from shoal.engine.frontend.logprobs import PositionLogprobs

FLOOR = -9999.0


def _clamp(value: float) -> float:
    return max(value, FLOOR)


def _utf8(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def token_id_placeholder(token_id: int) -> str:
    return f"token_id:{token_id}"


def completion_logprobs(token_ids: list[int], positions: list[PositionLogprobs | None],
                        token_string: Callable[[int], str],
                        initial_text_offset: int = 0, as_ids: bool = False) -> dict:
    """`positions[k]` belongs to `token_ids[k]`; None where the token has no logprobs."""
    if as_ids:
        token_string = token_id_placeholder
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    offset = initial_text_offset
    for token_id, pos in zip(token_ids, positions, strict=True):
        if pos is None:
            token = token_string(token_id)
            token_logprobs.append(None)
            top_logprobs.append(None)
        else:
            texts = [token_string(t) for t in pos.token_ids] if as_ids else pos.tokens
            token = texts[0]
            token_logprobs.append(_clamp(pos.logprob))
            by_id = dict(zip(pos.token_ids, zip(texts, pos.logprobs, strict=True),
                             strict=True))  # the sampled token first, then the top N
            top_logprobs.append({text: _clamp(lp) for text, lp in by_id.values()})
        tokens.append(token)
        text_offset.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


def chat_logprobs(positions: list[PositionLogprobs], as_ids: bool = False) -> dict:
    def texts(pos: PositionLogprobs) -> list[str]:
        return [token_id_placeholder(t) for t in pos.token_ids] if as_ids else pos.tokens

    return {"content": [
        {"token": texts(pos)[0], "logprob": _clamp(pos.logprob), "bytes": _utf8(pos.token),
         "top_logprobs": [{"token": t, "logprob": _clamp(lp), "bytes": _utf8(t)}
                          for t, lp in zip(texts(pos)[1:], pos.logprobs[1:], strict=True)]}
        for pos in positions]}


def prompt_logprobs(positions: list[PositionLogprobs | None]) -> list[dict | None]:
    out: list[dict | None] = []
    for pos in positions:
        if pos is None:
            out.append(None)
            continue
        ranks = [pos.rank, *range(1, len(pos.token_ids))]
        entry: dict[str, dict] = {}
        for token_id, text, lp, rank in zip(pos.token_ids, pos.tokens, pos.logprobs, ranks,
                                            strict=True):
            entry.setdefault(str(token_id), {"logprob": _clamp(lp), "rank": rank,
                                             "decoded_token": text})
        out.append(entry)
    return out
