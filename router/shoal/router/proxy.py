"""One client request forwarded to one engine group.

Retry rules: a request moves to another group while the chosen group has sent no response
bytes (it refused the connection, dropped it before answering, or answered 503), each group at
most once. It is also retried once, on another group, when the group failed before producing
any output for it (engine death): a 5xx answer other than 503, a connection that broke before
the whole non-streamed answer arrived, or a stream whose first event is a 5xx error event or
that broke before its first token. To tell, the start of a stream is held back until its first
event with output (text, a delta, a finish reason or usage): the chat role chunk waits for the
first token, which adds no time to the first token. Once output went to the client the router
is committed: the stream is passed through chunk by chunk, and a failure mid-way becomes an
in-band SSE error event (502) naming the engine and group. Without another usable group the
engine's own answer is passed on (a broken one becomes a 502). 4xx answers (the group validates
prompts and model names) pass through unchanged. A client that goes away closes the upstream
connection, so the group aborts the request. A request for an engine scaled to zero waits
for its first group before it gets here (hold.py).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio
import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from shoal.router.discovery import Group
from shoal.router.errors import error_response, no_group_message, sse_error
from shoal.router.metrics import RouterMetrics
from shoal.router.picker import GroupPicker
from shoal.router.upstream import (
    Disconnected,
    describe,
    event_data,
    event_kind,
    unless_disconnected,
    upstream_message,
    who,
)

logger = logging.getLogger("shoal.router.proxy")

# Sent on to the group; hop-by-hop and length headers are the HTTP client's business.
FORWARD_REQUEST_HEADERS = ("authorization", "content-type", "accept", "x-request-id")
FORWARD_RESPONSE_HEADERS = ("content-type", "x-request-id")
SSE_DONE = b"data: [DONE]\n\n"
# No read timeout: a long generation is not a failure. Connecting is quick or the group is gone.
UPSTREAM_TIMEOUT = httpx.Timeout(connect=3.0, read=None, write=60.0, pool=None)


class _NoOutput(Exception):
    """The group failed before any output: `cause` (metrics) and `detail` (messages)."""

    def __init__(self, cause: str, detail: str, held: bytes = b"") -> None:
        super().__init__(detail)
        self.cause, self.detail, self.held = cause, detail, held


@dataclass
class _Attempt:
    """One request's tries: which groups, why they failed, and whether the one retry after an
    engine failure was used."""

    tried: set = field(default_factory=set)
    failures: list = field(default_factory=list)
    died: bool = False
    missing: bool = False  # a group no longer had the request's adapter


class Proxy:
    def __init__(self, picker: GroupPicker, metrics: RouterMetrics,
                 client: httpx.AsyncClient) -> None:
        self.picker = picker
        self.metrics = metrics
        self.client = client

    async def forward(self, request: Request, path: str, body: bytes | None = None,
                      only: set | None = None, prefix: list[int] | None = None,
                      adapter: str | None = None) -> Response:
        """Send the request to a group (of `only`, if given; by `prefix` keys under
        prefix-affinity routing) and answer with what it answers. For an `adapter` request, a
        group's 404 (it unloaded the adapter since its list was read: no token was made) drops
        the adapter from that group's state and the request goes to another group listing it;
        with none left, the 404 is the router's, naming the adapter."""
        if body is None:
            body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k in FORWARD_REQUEST_HEADERS}
        run = _Attempt()
        while True:
            group = self.picker.pick(exclude=run.tried, only=only, prefix=prefix)
            if group is None and run.missing:
                return error_response(404, f"The model `{adapter}` does not exist: no group "
                                      f"has it loaded now ({'; '.join(run.failures)}).",
                                      "NotFoundError")
            if group is None:
                self.metrics.no_group.inc()
                others = self.picker.why_none(exclude=run.tried, only=only)
                why = "; ".join(x for x in (*run.failures, others) if x)
                return error_response(503, no_group_message(why), "ServiceUnavailableError")
            if run.tried:  # one line per retry: the group's own failure line comes only once
                self.metrics.retries.inc()  # per failure, and its health check may log it first
                logger.info("%s: %s; retrying on %s", path, run.failures[-1], group.name)
            run.tried.add(group.key)
            self._start(group)
            try:
                # A non-streamed answer sends its headers only when it is complete: watch the
                # client meanwhile, so leaving cancels the upstream request (the group aborts).
                upstream = await unless_disconnected(request, self.client.send(
                    self.client.build_request("POST", group.url + path, content=body,
                                              headers=headers), stream=True))
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                self._failed(group, path, "connect", f"could not connect: {describe(exc)}",
                             run.failures)
                continue
            except httpx.TransportError as exc:
                self._failed(group, path, "no_answer",
                             f"dropped the request before answering: {describe(exc)}",
                             run.failures)
                continue
            except Disconnected:
                return self._client_left(group, path)
            except BaseException as exc:  # cancelled (server shutdown)
                logger.info("request to %s cancelled (%s)", group.name, describe(exc))
                self._finish(group, path, "disconnect")
                raise
            if upstream.status_code == 503:
                raw = await self._read_quietly(upstream)
                self._failed(group, path, "unavailable",
                             f"answered 503: {upstream_message(raw)}", run.failures)
                continue
            if upstream.status_code == 404 and adapter is not None:
                raw = await self._read_quietly(upstream)
                self._finish(group, path, "client_error")
                self.metrics.adapter_misses.inc()
                self.picker.forget_adapter(group.key, adapter)
                run.missing = True
                run.failures.append(f"{group.name} answered 404: {upstream_message(raw)}")
                logger.info("%s: %s no longer has adapter %s; trying another group", path,
                            group.name, adapter)
                continue
            try:
                return await self._respond(request, upstream, group, path, run, only)
            except _NoOutput as exc:
                self._failed(group, path, exc.cause, exc.detail, run.failures)
                continue

    def _may_retry(self, run: _Attempt, only: set | None) -> bool:
        """One more try after an engine failure, if it is the first and another group can."""
        if run.died or not self.picker.any_usable(exclude=run.tried, only=only):
            return False
        run.died = True
        return True

    # ----- one group's answer --------------------------------------------------------------

    async def _respond(self, request: Request, upstream: httpx.Response, group: Group,
                       path: str, run: _Attempt, only: set | None) -> Response:
        """The client's answer from `upstream`; raises _NoOutput (upstream closed, the request
        released) when the group failed before any output and a retry is allowed."""
        headers = {k: v for k, v in upstream.headers.items() if k in FORWARD_RESPONSE_HEADERS}
        if upstream.headers.get("content-type", "").startswith("text/event-stream"):
            return await self._respond_stream(request, upstream, group, path, run, only,
                                              headers)
        try:
            content = await unless_disconnected(request, upstream.aread())
        except Disconnected:
            await self._close(upstream)
            return self._client_left(group, path)
        except httpx.HTTPError as exc:
            await self._close(upstream)
            detail = f"failed before answering in full: {describe(exc)}"
            if self._may_retry(run, only):
                raise _NoOutput("no_output", detail) from None
            self.metrics.upstream_errors.labels(group.label, "midway").inc()
            self.picker.mark_failed(group, f"failed mid-response: {describe(exc)}")
            self._finish(group, path, "upstream_error")
            return error_response(
                502, f"{who(group)} ({group.url}) failed mid-response: {describe(exc)}",
                "BadGatewayError")
        await self._close(upstream)
        if upstream.status_code >= 500 and self._may_retry(run, only):
            raise _NoOutput("server_error", f"answered {upstream.status_code}: "
                                            f"{upstream_message(content)}")
        outcome = self._outcome(group, upstream.status_code)
        if outcome != "upstream_error":
            self.picker.mark_ok(group)
        self._finish(group, path, outcome)
        return Response(content, status_code=upstream.status_code, headers=headers)

    async def _respond_stream(self, request: Request, upstream: httpx.Response, group: Group,
                              path: str, run: _Attempt, only: set | None,
                              headers: dict) -> Response:
        chunks = upstream.aiter_bytes()
        try:
            held = await unless_disconnected(request, self._hold(chunks, upstream))
        except Disconnected:
            await self._close(upstream)
            return self._client_left(group, path)
        except _NoOutput as exc:
            if self._may_retry(run, only):
                await self._close(upstream)
                raise
            if not exc.held:  # nothing at all came: no stream to pass on
                await self._close(upstream)
                self.metrics.upstream_errors.labels(group.label, exc.cause).inc()
                self.picker.mark_failed(group, exc.detail)
                self._finish(group, path, "upstream_error")
                return error_response(502, f"{who(group)} ({group.url}) {exc.detail}",
                                      "BadGatewayError")
            held = exc.held  # the engine's own error event, passed on with the rest
        outcome = self._outcome(group, upstream.status_code)
        if outcome != "upstream_error":
            self.picker.mark_ok(group)
        return StreamingResponse(self._stream(held, chunks, upstream, group, path, outcome),
                                 status_code=upstream.status_code, headers=headers)

    @staticmethod
    async def _hold(chunks: AsyncIterator[bytes], upstream: httpx.Response) -> bytes:
        """Read the stream until its first event with output; return what was read. Raises
        _NoOutput when it ends, breaks or reports a 5xx error before that."""
        held = b""
        scanned = 0
        try:
            async for chunk in chunks:
                held += chunk
                while (end := held.find(b"\n\n", scanned)) >= 0:
                    event = held[scanned:end]
                    scanned = end + 2
                    kind, code = event_kind(event)
                    if kind == "output" or (kind == "error" and code < 500):
                        return held
                    if kind == "error":
                        raise _NoOutput("server_error", "failed before any output: "
                                        f"{upstream_message(event_data(event))}", held)
        except httpx.HTTPError as exc:
            raise _NoOutput("no_output", f"failed before any output: {describe(exc)}") from None
        raise _NoOutput("no_output", "failed before any output: the stream ended", held)

    async def _stream(self, held: bytes, chunks: AsyncIterator[bytes],
                      upstream: httpx.Response, group: Group, path: str,
                      outcome: str) -> AsyncIterator[bytes]:
        tail = held[-len(SSE_DONE):]
        try:
            yield held
            async for chunk in chunks:
                tail = (tail + chunk)[-len(SSE_DONE):]
                yield chunk
        except httpx.HTTPError as exc:
            outcome = "upstream_error"
            self.metrics.upstream_errors.labels(group.label, "midway").inc()
            self.picker.mark_failed(group, f"failed mid-stream: {describe(exc)}")
            yield sse_error(502, f"{who(group)} ({group.url}) failed mid-stream: "
                                 f"{describe(exc)}", "BadGatewayError")
            yield SSE_DONE
        except BaseException:  # cancelled or closed: the client went away
            if tail != SSE_DONE:  # (a client may hang up after [DONE], before the EOF)
                outcome = "disconnect"
                logger.info("client disconnected; closing the stream to %s", group.name)
            raise
        finally:
            await self._close(upstream)
            self._finish(group, path, outcome)

    def _client_left(self, group: Group, path: str) -> Response:
        logger.info("client disconnected; cancelled its request to %s", group.name)
        self._finish(group, path, "disconnect")
        return Response(status_code=499)

    @staticmethod
    async def _close(upstream: httpx.Response) -> None:
        with anyio.CancelScope(shield=True):
            await upstream.aclose()

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
        self.metrics.upstream_errors.labels(group.label, "server_error").inc()
        return "upstream_error"

    def _start(self, group: Group) -> None:
        self.picker.acquire(group)
        self.metrics.outstanding.labels(group.label).inc()

    def _finish(self, group: Group, path: str, outcome: str) -> None:
        self.picker.release(group)
        self.metrics.outstanding.labels(group.label).dec()
        self.metrics.requests.labels(group.label, path, outcome).inc()

    def _failed(self, group: Group, path: str, cause: str, detail: str,
                failures: list[str]) -> None:
        self._finish(group, path, "upstream_error")
        self.metrics.upstream_errors.labels(group.label, cause).inc()
        self.picker.mark_failed(group, detail)
        failures.append(f"{group.name} ({group.url}) {detail}")
