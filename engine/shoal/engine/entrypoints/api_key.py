"""--api-key: every /v1 request must carry `Authorization: Bearer <key>` with one of the keys,
else OpenAI's 401.

The keys, as vLLM takes them: `--api-key K1 K2 ...` (several, for rotation), else the
environment: `SHOAL_API_KEY` and vLLM's `VLLM_API_KEY`, so a vLLM manifest that sets the key by
env var is not served open. The scheme is matched case-insensitively and every key is compared
(in constant time, as digests), as vLLM's AuthenticationMiddleware does.

A plain ASGI wrapper, not Starlette's BaseHTTPMiddleware (`@app.middleware("http")`): that one
relays the response through in-memory streams and runs the endpoint in a task of its own, and
with it a streaming response sometimes never learned that its client had gone, so the request
generated to its end (measured: 4 of 12 mid-stream disconnects). Here `receive` and `send` pass
through untouched, so the response sees the disconnect itself and the request is aborted.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

from shoal.engine.entrypoints.http_errors import error_response
from starlette.types import ASGIApp, Receive, Scope, Send

MESSAGE = ("invalid or missing API key: send 'Authorization: Bearer <key>' with a key given "
           "to --api-key")
ENV_KEYS = ("SHOAL_API_KEY", "VLLM_API_KEY")


def api_keys(flag: list[str] | None, environ: Mapping[str, str]) -> list[str]:
    """The accepted keys: the flag's if given (it wins, as in vLLM), else each key variable
    that is set. Empty means no authentication."""
    if flag:
        return [k for k in flag if k]
    return [environ[name] for name in ENV_KEYS if environ.get(name)]


def _digest(text: bytes) -> bytes:
    return hashlib.sha256(text).digest()


class ApiKeyAuth:
    def __init__(self, app: ASGIApp, api_keys: list[str]) -> None:
        self.app = app
        self.digests = [_digest(k.encode()) for k in api_keys]

    def accepts(self, header: bytes) -> bool:
        scheme, _, token = header.partition(b" ")
        given = _digest(token)
        ok = False
        for d in self.digests:  # every key, so the time says nothing about which one matched
            ok |= hmac.compare_digest(given, d)
        return ok and scheme.lower() == b"bearer"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            if not self.accepts(dict(scope["headers"]).get(b"authorization", b"")):
                await error_response(401, MESSAGE, "AuthenticationError")(scope, receive, send)
                return
        await self.app(scope, receive, send)
