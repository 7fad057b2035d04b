"""One client request forwarded to one engine group.

Retry rule: a request moves to another group only while the chosen group has sent no response
bytes (it refused the connection, dropped it before answering, or answered 503). After that the
router is committed: a stream is passed through chunk by chunk as it arrives, and a failure
mid-way becomes a 502 naming the group (an in-band SSE error event once a stream's 200 headers
are out). 4xx answers (the group validates prompts and model names) pass through unchanged.
A client that goes away closes the upstream connection, so the group aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import anyio
import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from shoal.engine.router.discovery import Group
from shoal.engine.router.errors import error_response, no_group_message, sse_error
from shoal.engine.router.metrics import RouterMetrics
from shoal.engine.router.picker import GroupPicker

logger = logging.getLogger("shoal.router.proxy")

# Sent on to the group; hop-by-hop and length headers are the HTTP client's business.
FORWARD_REQUEST_HEADERS = ("authorization", "content-type", "accept", "x-request-id")
FORWARD_RESPONSE_HEADERS = ("content-type", "x-request-id")
# No read timeout: a long generation is not a failure. Connecting is quick or the group is gone.
SSE_DONE = b"data: [DONE]\n\n"
UPSTREAM_TIMEOUT = httpx.Timeout(connect=3.0, read=None, write=60.0, pool=None)


def describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if text != type(exc).__name__ else text


def _upstream_message(body: bytes) -> str:
    """The `error.message` of a group's OpenAI error JSON, else the start of its body."""
    import json

    with contextlib.suppress(ValueError, AttributeError, TypeError):
        return str(json.loads(body)["error"]["message"])
    return body[:200].decode(errors="replace") or "(empty body)"


class _Disconnected(Exception):
    pass


async def _unless_disconnected(request: Request, coro):
    """`await coro`, unless the client disconnects first: then cancel it and raise
    _Disconnected."""
    task = asyncio.ensure_future(coro)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    raise _Disconnected


class Proxy:
    def __init__(self, picker: GroupPicker, metrics: RouterMetrics,
                 client: httpx.AsyncClient) -> None:
        self.picker = picker
        self.metrics = metrics
        self.client = client

    async def forward(self, request: Request, path: str) -> Response:
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k in FORWARD_REQUEST_HEADERS}
        failures: list[str] = []
        tried: set[int] = set()
        while True:
            group = self.picker.pick(exclude=tried)
            if group is None:
                self.metrics.no_group.inc()
                others = self.picker.why_none(exclude=tried)
                why = "; ".join(x for x in (*failures, others) if x)
                return error_response(503, no_group_message(why), "ServiceUnavailableError")
            if tried:
                self.metrics.retries.inc()
            tried.add(group.id)
            self._start(group)
            try:
                # A non-streamed answer sends its headers only when it is complete: watch the
                # client meanwhile, so leaving cancels the upstream request (the group aborts).
                upstream = await _unless_disconnected(request, self.client.send(
                    self.client.build_request("POST", group.url + path, content=body,
                                              headers=headers), stream=True))
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                self._failed(group, path, "connect", f"could not connect: {describe(exc)}",
                             failures)
                continue
            except httpx.TransportError as exc:
                self._failed(group, path, "no_answer",
                             f"dropped the request before answering: {describe(exc)}", failures)
                continue
            except _Disconnected:
                return self._client_left(group, path)
            except BaseException as exc:  # cancelled (server shutdown)
                logger.info("request to group %d cancelled (%s)", group.id, describe(exc))
                self._finish(group, path, "disconnect")
                raise
            if upstream.status_code == 503:
                raw = await self._read_quietly(upstream)
                self._failed(group, path, "unavailable",
                             f"answered 503: {_upstream_message(raw)}", failures)
                continue
            return await self._respond(request, upstream, group, path)

    # ----- committed to one group ---------------------------------------------------------

    async def _respond(self, request: Request, upstream: httpx.Response, group: Group,
                       path: str) -> Response:
        headers = {k: v for k, v in upstream.headers.items() if k in FORWARD_RESPONSE_HEADERS}
        outcome = self._outcome(group, upstream.status_code)
        if outcome != "upstream_error":
            self.picker.mark_ok(group)
        if upstream.headers.get("content-type", "").startswith("text/event-stream"):
            return StreamingResponse(self._stream(upstream, group, path, outcome),
                                     status_code=upstream.status_code, headers=headers)
        try:
            content = await _unless_disconnected(request, upstream.aread())
        except _Disconnected:
            return self._client_left(group, path)
        except httpx.HTTPError as exc:
            self.metrics.upstream_errors.labels(str(group.id), "midway").inc()
            self.picker.mark_failed(group, f"failed mid-response: {describe(exc)}")
            self._finish(group, path, "upstream_error")
            return error_response(
                502, f"engine group {group.id} ({group.url}) failed mid-response: "
                     f"{describe(exc)}", "BadGatewayError")
        finally:
            with anyio.CancelScope(shield=True):
                await upstream.aclose()
        self._finish(group, path, outcome)
        return Response(content, status_code=upstream.status_code, headers=headers)

    async def _stream(self, upstream: httpx.Response, group: Group, path: str,
                      outcome: str) -> AsyncIterator[bytes]:
        tail = b""
        try:
            async for chunk in upstream.aiter_bytes():
                tail = (tail + chunk)[-len(SSE_DONE):]
                yield chunk
        except httpx.HTTPError as exc:
            outcome = "upstream_error"
            self.metrics.upstream_errors.labels(str(group.id), "midway").inc()
            self.picker.mark_failed(group, f"failed mid-stream: {describe(exc)}")
            yield sse_error(502, f"engine group {group.id} ({group.url}) failed mid-stream: "
                                 f"{describe(exc)}", "BadGatewayError")
            yield SSE_DONE
        except BaseException:  # cancelled or closed: the client went away
            if tail != SSE_DONE:  # (a client may hang up after [DONE], before the EOF)
                outcome = "disconnect"
                logger.info("client disconnected; closing the stream to group %d", group.id)
            raise
        finally:
            with anyio.CancelScope(shield=True):
                await upstream.aclose()
            self._finish(group, path, outcome)

    def _client_left(self, group: Group, path: str) -> Response:
        logger.info("client disconnected; cancelled its request to group %d", group.id)
        self._finish(group, path, "disconnect")
        return Response(status_code=499)

    @staticmethod
    async def _read_quietly(upstream: httpx.Response) -> bytes:
        try:
            return await upstream.aread()
        except httpx.HTTPError:
            return b""
        finally:
            await upstream.aclose()

    # ----- bookkeeping --------------------------------------------------------------------

    def _outcome(self, group: Group, status: int) -> str:
        if status < 400:
            return "ok"
        if status < 500:
            return "client_error"
        self.metrics.upstream_errors.labels(str(group.id), "server_error").inc()
        return "upstream_error"

    def _start(self, group: Group) -> None:
        self.picker.acquire(group)
        self.metrics.outstanding.labels(str(group.id)).inc()

    def _finish(self, group: Group, path: str, outcome: str) -> None:
        self.picker.release(group)
        self.metrics.outstanding.labels(str(group.id)).dec()
        self.metrics.requests.labels(str(group.id), path, outcome).inc()

    def _failed(self, group: Group, path: str, cause: str, detail: str,
                failures: list[str]) -> None:
        self._finish(group, path, "upstream_error")
        self.metrics.upstream_errors.labels(str(group.id), cause).inc()
        self.picker.mark_failed(group, detail)
        failures.append(f"group {group.id} ({group.url}) {detail}")
