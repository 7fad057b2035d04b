"""--api-key: every /v1 request must carry `Authorization: Bearer <key>` with one of the keys,
else OpenAI's 401.

Which keys, and how a header is checked, is `shoal.contract.auth` (the routers use the same):
`--api-key K1 K2 ...`, else `SHOAL_API_KEY` and vLLM's `VLLM_API_KEY`.

A plain ASGI wrapper, not Starlette's BaseHTTPMiddleware (`@app.middleware("http")`): that one
relays the response through in-memory streams and runs the endpoint in a task of its own, and
with it a streaming response sometimes never learned that its client had gone, so the request
generated to its end (measured: 4 of 12 mid-stream disconnects). Here `receive` and `send` pass
through untouched, so the response sees the disconnect itself and the request is aborted.
"""

from __future__ import annotations

from shoal.contract.auth import KeyCheck
from shoal.engine.entrypoints.http_errors import error_response
from starlette.types import ASGIApp, Receive, Scope, Send

MESSAGE = ("invalid or missing API key: send 'Authorization: Bearer <key>' with a key given "
           "to --api-key")


class ApiKeyAuth:
    def __init__(self, app: ASGIApp, api_keys: list[str]) -> None:
        self.app = app
        self.check = KeyCheck(api_keys)

    def accepts(self, header: bytes) -> bool:
        return self.check.accepts(header)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            if not self.accepts(dict(scope["headers"]).get(b"authorization", b"")):
                await error_response(401, MESSAGE, "AuthenticationError")(scope, receive, send)
                return
        await self.app(scope, receive, send)
