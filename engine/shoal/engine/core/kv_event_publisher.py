"""The KV event publisher of the EngineCore process: vLLM 0.32's ZmqEventPublisher, message for
message (vllm/distributed/kv_events.py), so its consumers need nothing Shoal-specific.

- `publish(batch)` (the engine's thread, once a step with events) queues the batch; the queue
  is bounded (`max_queue_size`) and a full one blocks the engine, as vLLM's does: a batch is
  never dropped before it has a sequence number, so a consumer sees every loss as a gap.
- One background thread numbers the batches (0, 1, ... from engine start), encodes them
  (msgpack), sends (topic, 8-byte big-endian seq, payload) on the PUB socket (`hwm`: beyond it
  ZeroMQ drops for a slow subscriber, who sees the gap) and keeps the last `buffer_steps`
  payloads for replay.
- The replay ROUTER socket (`replay_endpoint`, optional): a request (identity, empty, 8-byte
  start seq) is answered with every buffered batch from that seq as (identity, empty, topic,
  seq, payload), then the end marker (identity, empty, b"", seq -1, b""). When the buffer no
  longer reaches back to `start` (vLLM then sends what it has, and the consumer has a hole),
  Shoal answers with one snapshot batch instead (kv_snapshot.py: AllBlocksCleared, then every
  cached block) under the last sequence number sent: a router that starts after the engine has
  run for a while learns the whole cache, not just what changes next.
`endpoint` is bound when it holds "*" or "::" or is ipc://, else connected (a consumer that
binds); the replay endpoint is always bound. A socket that cannot bind is a start-up error
naming the endpoint.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque

import msgspec
import zmq
from shoal.engine.core.kv_events import EventBatch
from shoal.engine.core.kv_snapshot import CacheMirror
from shoal.engine.kv_events_config import KVEventsConfig

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
SHUTDOWN_TIMEOUT_S = 1.0
_POLL_S = 0.1  # the thread's wait on the queue: the replay socket's latency when idle


def binds(endpoint: str) -> bool:
    """vLLM's rule: wildcard and ipc/inproc endpoints are bound, the rest connected."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self.config = config
        self._dp_rank = data_parallel_rank
        self._queue: queue.Queue[EventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode("utf-8")
        # What the cache holds, for replays the buffer cannot cover (only with a replay socket).
        self._mirror = CacheMirror() if config.replay_endpoint is not None else None
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = None
        try:
            self._pub.set_hwm(config.hwm)
            self._attach(self._pub, config.endpoint, binds(config.endpoint), "endpoint")
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._attach(self._replay, config.replay_endpoint, True, "replay_endpoint")
        except BaseException:
            self._close_sockets()
            raise
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()
        log.info("KV events: publishing on %s%s (topic %r)", config.endpoint,
                 f", replay on {config.replay_endpoint}" if config.replay_endpoint else "",
                 config.topic)

    @staticmethod
    def _attach(sock, endpoint: str, bind: bool, name: str) -> None:
        try:
            sock.bind(endpoint) if bind else sock.connect(endpoint)
        except zmq.ZMQError as exc:
            raise RuntimeError(f"--kv-events-config {name} {endpoint!r}: cannot "
                               f"{'bind' if bind else 'connect'}: {exc}") from None

    def publish(self, batch: EventBatch) -> None:
        if not self._running:
            raise RuntimeError("the KV event publisher is shut down")
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self._dp_rank
        self._queue.put(batch)

    def _run(self) -> None:
        encode = msgspec.msgpack.Encoder().encode
        seq = 0
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except Exception:  # noqa: BLE001 - a bad request must not stop publishing
                    log.exception("KV events: replay request failed")
            try:
                batch = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if batch is None:
                return
            payload = encode(batch)
            seq_bytes = seq.to_bytes(8, "big")
            try:
                self._pub.send_multipart((self._topic, seq_bytes, payload))
            except zmq.ZMQError:
                log.exception("KV events: sending batch %d failed", seq)
            self._buffer.append((seq, payload))
            if self._mirror is not None:
                self._mirror.apply(batch)
            seq += 1

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("KV events: replay request of %d frames ignored (want identity, "
                        "empty, 8-byte start sequence)", len(frames))
            return
        ident, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        if self._buffer and start < self._buffer[0][0] and self._mirror is not None:
            last = self._buffer[-1][0]
            snap = self._mirror.snapshot(self._dp_rank)
            log.info("KV events: replay from %d asked, the buffer starts at %d: sending a "
                     "snapshot of %d blocks as batch %d", start, self._buffer[0][0],
                     len(self._mirror), last)
            self._replay.send_multipart((ident, b"", self._topic, last.to_bytes(8, "big"),
                                         msgspec.msgpack.encode(snap)))
            self._replay.send_multipart((ident, b"", b"", END_SEQ, b""))
            return
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((ident, b"", self._topic, seq.to_bytes(8, "big"),
                                             payload))
        self._replay.send_multipart((ident, b"", b"", END_SEQ, b""))

    def shutdown(self) -> None:
        """Send what is queued (up to SHUTDOWN_TIMEOUT_S), stop the thread, close the sockets."""
        if not self._running:
            return
        self._running = False
        try:
            self._queue.put(None, timeout=SHUTDOWN_TIMEOUT_S)
        except queue.Full:
            pass
        self._thread.join(SHUTDOWN_TIMEOUT_S)
        if self._thread.is_alive():  # its sockets are its own until it stops: left to exit
            log.warning("KV events: publisher still sending at shutdown, %d batches queued",
                        self._queue.qsize())
            return
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()
