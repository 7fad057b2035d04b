"""API keys: which keys a server accepts, and the check of one `Authorization` header.

Shared by `shoal serve`, `shoal router` and `shoal gateway` so that all three read the same
variables in the same order as vLLM: the `--api-key K1 K2 ...` flag when given (several keys, for
rotation), else each of `SHOAL_API_KEY` and vLLM's `VLLM_API_KEY` that is set, so a manifest
written for vLLM is never served open. The scheme is matched case-insensitively and every key is
compared (in constant time, as digests), as vLLM's AuthenticationMiddleware does.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

ENV_KEYS = ("SHOAL_API_KEY", "VLLM_API_KEY")


def api_keys(flag: list[str] | None, environ: Mapping[str, str]) -> list[str]:
    """The accepted keys: the flag's if given (it wins, as in vLLM), else each key variable
    that is set. Empty means no authentication."""
    if flag:
        return [k for k in flag if k]
    return [environ[name] for name in ENV_KEYS if environ.get(name)]


def add_api_key_argument(parser) -> None:
    """`--api-key K1 [K2 ...]` on an argparse parser or group, worded the same everywhere."""
    parser.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on /v1/* with one of these keys "
                             "(several for rotation, as vLLM); default: $SHOAL_API_KEY and "
                             "$VLLM_API_KEY, each one set")


def _digest(text: bytes) -> bytes:
    return hashlib.sha256(text).digest()


class KeyCheck:
    """Accepts `Bearer <key>` for any of `keys`; with no keys, everything."""

    def __init__(self, keys: list[str]) -> None:
        self.digests = [_digest(k.encode()) for k in keys]

    def __bool__(self) -> bool:
        return bool(self.digests)

    def accepts(self, header: bytes | str | None) -> bool:
        if not self.digests:
            return True
        raw = header.encode() if isinstance(header, str) else (header or b"")
        scheme, _, token = raw.partition(b" ")
        given = _digest(token)
        ok = False
        for d in self.digests:  # every key, so the time says nothing about which one matched
            ok |= hmac.compare_digest(given, d)
        return ok and scheme.lower() == b"bearer"
