"""--api-key: every /v1 request must carry `Authorization: Bearer <key>`, else OpenAI's 401.

A plain ASGI wrapper, not Starlette's BaseHTTPMiddleware (`@app.middleware("http")`): that one
relays the response through in-memory streams and runs the endpoint in a task of its own, and
with it a streaming response sometimes never learned that its client had gone, so the request
generated to its end (measured: 4 of 12 mid-stream disconnects). Here `receive` and `send` pass
through untouched, so the response sees the disconnect itself and the request is aborted.
"""

from __future__ import annotations

import hmac

from shoal.engine.entrypoints.http_errors import error_response
from starlette.types import ASGIApp, Receive, Scope, Send

MESSAGE = ("invalid or missing API key: send 'Authorization: Bearer <key>' with the key given "
           "to --api-key")


class ApiKeyAuth:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            header = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(header, self.expected):
                await error_response(401, MESSAGE, "AuthenticationError")(scope, receive, send)
                return
        await self.app(scope, receive, send)
