"""The routers' subscription to every group's KV events (vLLM's ZMQ PUB, kv_wire.py), feeding
the index (kv_index.py).

One asyncio task per group: a SUB socket on the group's event endpoint; each batch goes to
`KvIndex.apply`. A new subscription first asks the replay endpoint for everything it keeps
(from sequence 0: a snapshot where the buffer no longer reaches back), so the index holds the
group's cache before its next event. On a gap (a sequence number skipped, the router's first
batch of a group not being 0, or a restarted engine) it asks the group's replay endpoint, as
vLLM's protocol has it:
a DEALER sends (b"", start seq as 8 bytes); the ROUTER answers (b"", topic, seq, payload) per
buffered batch from `start`, then (b"", b"", -1, b""). What the replay cannot cover (no replay
endpoint, no answer within REPLAY_TIMEOUT_S, the buffer moved past it) clears that group
(`accept_gap`) rather than trusting entries whose removal may have been missed; a replay that
answers with a snapshot (a first batch that begins AllBlocksCleared: Shoal's engine, when its
buffer no longer reaches back) is the complete state (`accept_snapshot`). A tick each
second recomputes which groups are stale (the connection to the publisher down, per ZMQ's
socket monitor, for the index's disconnected_after; or traffic but no batch for its
stale_after): one log line per transition; the scorer then scores them by load only.

Endpoints: until discovery carries them, a group's are its URL's host with the ports given to
the router (`--kv-events-port`, `--kv-replay-port`), or given per group (`--kv-endpoint
LABEL=EVENTS[,REPLAY]`: several groups on one host, e.g. on loopback).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import msgspec
import zmq
import zmq.asyncio
from shoal.router.kv_index import APPLIED, DUPLICATE, Gap, KvIndex
from shoal.router.kv_wire import END_SEQ, AllBlocksCleared, decode_batch, decode_seq, encode_seq
from zmq.utils.monitor import parse_monitor_message

logger = logging.getLogger("shoal.router.kv")

REPLAY_TIMEOUT_S = 2.0
TICK_S = 1.0
RETRY_S = 1.0


@dataclass(frozen=True)
class Endpoints:
    events: str
    replay: str | None


def parse_endpoint(spec: str) -> tuple[str, Endpoints]:
    """`LABEL=EVENTS[,REPLAY]` (a group's metrics label: "1", or "ns/engine/1" in the gateway);
    ValueError says what is wrong."""
    label, sep, rest = spec.partition("=")
    events, _, replay = rest.partition(",")
    for ep in (events, replay):
        if ep and not ep.startswith("tcp://"):
            raise ValueError(f"--kv-endpoint {spec!r}: {ep!r} is not a tcp:// endpoint")
    if not sep or not label or not events:
        raise ValueError(f"--kv-endpoint {spec!r} is not LABEL=EVENTS[,REPLAY]")
    return label, Endpoints(events, replay or None)


def endpoints_from_ports(events_port: int, replay_port: int | None,
                         given: dict[str, Endpoints] | None = None):
    """Group -> Endpoints: those `given` for its label, else its URL's host with fixed ports."""
    def of(group) -> Endpoints:
        if given and group.label in given:
            return given[group.label]
        host = urlsplit(group.url).hostname
        host = f"[{host}]" if host and ":" in host else host
        return Endpoints(f"tcp://{host}:{events_port}",
                         f"tcp://{host}:{replay_port}" if replay_port else None)
    return of


class KvSubscriber:
    def __init__(self, index: KvIndex, endpoints_of: Callable[[object], Endpoints],
                 clock: Callable[[], float] = time.monotonic,
                 replay_timeout: float = REPLAY_TIMEOUT_S) -> None:
        self.index = index
        self.endpoints_of = endpoints_of
        self.clock = clock
        self.replay_timeout = replay_timeout
        self.ctx = zmq.asyncio.Context()
        self.replays = 0
        self.decode_errors = 0
        self._tasks: dict = {}  # group key -> (Endpoints, task)
        self._wanted: dict = {}  # group key -> (Group, Endpoints), from discovery

    def set_groups(self, groups) -> None:
        """Follow discovery: subscribe to new groups, drop gone ones, resubscribe (new epoch)
        when a group's endpoint moved. Before the loop runs, remembered for `run`."""
        self._wanted = {g.key: (g, self.endpoints_of(g)) for g in groups}
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        self._sync()

    def _sync(self) -> None:
        wanted = self._wanted
        for key in list(self._tasks):
            ep, task = self._tasks[key]
            if key not in wanted or wanted[key][1] != ep:
                task.cancel()
                del self._tasks[key]
                self.index.drop(key)
        for key, (group, ep) in wanted.items():
            if key not in self._tasks:
                self.index.set_epoch(key, ep)
                self._tasks[key] = (ep, asyncio.ensure_future(self._follow(group, key, ep)))

    async def run(self) -> None:
        """The subscriptions and the stale tick, for the app's lifespan (until cancelled)."""
        self._sync()
        try:
            while True:
                await asyncio.sleep(TICK_S)
                self.tick()
        finally:
            for _, task in self._tasks.values():
                task.cancel()
            await asyncio.gather(*(t for _, t in self._tasks.values()), return_exceptions=True)
            self._tasks.clear()
            self.ctx.destroy(linger=0)

    def tick(self) -> None:
        now = self.clock()
        became, recovered = self.index.refresh_stale(now)
        for key in became:
            logger.warning("KV events of %s stopped (%s); scoring it by load only",
                           self._name(key), self.index.why_stale(key, now))
        for key in recovered:
            logger.info("KV events of %s resumed", self._name(key))

    def _name(self, key) -> str:
        found = self._wanted.get(key)
        return found[0].name if found else f"group {key}"

    async def _follow(self, group, key, ep: Endpoints) -> None:
        """Follow one group for ever; a failed subscription is logged and started again (the
        batches it missed come back as a gap, replayed)."""
        while True:
            sub = self.ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.LINGER, 0)
            monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            watch = asyncio.ensure_future(self._watch(key, monitor))
            self.index.set_connected(key, False, self.clock())  # until it connects
            try:
                sub.connect(ep.events)
                logger.info("%s: following KV events at %s (replay %s)", group.name, ep.events,
                            ep.replay or "none")
                if ep.replay is not None and self.index.last_seq(key) is None:
                    await self._replay(group, key, ep, 0, None)  # the cache as it is now
                while True:
                    frames = await sub.recv_multipart()
                    await self._offer(group, key, ep, frames)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - logged; followed again after a pause
                logger.exception("%s: KV event subscription at %s failed; again in %g s",
                                 group.name, ep.events, RETRY_S)
            finally:
                watch.cancel()
                sub.disable_monitor()
                monitor.close(linger=0)
                sub.close(linger=0)
            await asyncio.sleep(RETRY_S)

    async def _watch(self, key, monitor) -> None:
        """The SUB socket's connection to the publisher, into the index (staleness)."""
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())["event"]
            self.index.set_connected(key, event == zmq.EVENT_CONNECTED, self.clock())

    def _decode(self, group, frames):
        if len(frames) != 3:
            raise ValueError(f"{len(frames)} frames, not (topic, seq, payload)")
        return decode_seq(frames[1]), decode_batch(frames[2])

    async def _offer(self, group, key, ep: Endpoints, frames) -> None:
        try:
            seq, batch = self._decode(group, frames)
        except (ValueError, msgspec.DecodeError) as exc:
            self.decode_errors += 1
            logger.warning("%s: undecodable KV event message from %s: %s", group.name,
                           ep.events, exc)
            return
        verdict = self.index.apply(key, seq, batch, self.clock())
        if isinstance(verdict, Gap):
            await self._replay(group, key, ep, verdict.start, seq)
            verdict = self.index.apply(key, seq, batch, self.clock())
            if isinstance(verdict, Gap):  # the replay did not reach it
                self.index.accept_gap(key, seq)
                self.index.apply(key, seq, batch, self.clock())

    async def _replay(self, group, key, ep: Endpoints, start: int, upto: int | None) -> None:
        """Ask for batches from `start`, applying them in order, until the end marker. `upto`
        None: the group's first batches, asked as soon as the subscription starts (a router
        that (re)starts learns each group's cache at once, not at the group's next event: at
        4 req/s the index was whole only 1 s after a restart, and the first 2 s were misses)."""
        if ep.replay is None:
            logger.warning("%s: KV events %d..%d missed and no replay endpoint: clearing its "
                           "index entries", group.name, start, upto - 1)
            return
        self.replays += 1
        if upto is None:
            logger.info("%s: asking %s for the KV events it keeps", group.name, ep.replay)
        else:
            logger.info("%s: KV events %d..%d missed; replaying from %s", group.name, start,
                        upto - 1, ep.replay)
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(ep.replay)
        try:
            await dealer.send_multipart((b"", encode_seq(start)))
            while True:
                if not await dealer.poll(self.replay_timeout * 1000):
                    logger.warning("%s: replay from %s did not finish within %g s", group.name,
                                   ep.replay, self.replay_timeout)
                    return
                frames = await dealer.recv_multipart()
                seq = decode_seq(frames[2]) if len(frames) == 4 else None
                if seq == END_SEQ:
                    return
                if seq is None:
                    raise ValueError(f"replay answered {len(frames)} frames")
                batch = decode_batch(frames[3])
                verdict = self.index.apply(key, seq, batch, self.clock())
                if isinstance(verdict, Gap):  # the buffer starts past what we need
                    if batch.events and isinstance(batch.events[0], AllBlocksCleared):
                        logger.info("%s: replay answered with a snapshot (%d events) as batch "
                                    "%d", group.name, len(batch.events) - 1, seq)
                        self.index.accept_snapshot(key, seq)
                    else:
                        self.index.accept_gap(key, seq)
                    self.index.apply(key, seq, batch, self.clock())
                elif verdict not in (APPLIED, DUPLICATE):
                    raise AssertionError(verdict)
        finally:
            dealer.close(linger=0)


@dataclass
class KvRouting:
    """kv-aware routing's parts for one router: the index, the picker's policy and the
    subscription that feeds the index."""

    index: KvIndex
    aware: object  # kv_score.KvAware
    subscriber: KvSubscriber

    def set_groups(self, groups) -> None:
        self.subscriber.set_groups(groups)


def make_kv_routing(tokenizer: str | None, events_port: int, replay_port: int | None,
                    endpoints: list[str] = ()) -> KvRouting:
    """ValueError names what is missing (kv-aware needs the model's tokenizer)."""
    from shoal.router.kv_score import KvAware, load_encoder

    if not tokenizer:
        raise ValueError("routing kv-aware needs the model's tokenizer.json (--kv-tokenizer or "
                         "$SHOAL_ROUTER_KV_TOKENIZER)")
    given = dict(parse_endpoint(spec) for spec in endpoints)
    index = KvIndex()
    aware = KvAware(index, load_encoder(tokenizer))
    return KvRouting(index, aware, KvSubscriber(
        index, endpoints_from_ports(events_port, replay_port, given)))
