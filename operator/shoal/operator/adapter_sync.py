"""Loading InferenceAdapters into an engine's groups, through vLLM's own endpoints
(shoal.contract.lora), and proving each one through the frontend Service.

One task per engine on kopf's event loop, every SYNC_INTERVAL_SECONDS while the engine has a
group whose rank 0 is Ready and an adapter to serve:
1. read each group's `/v1/models` (what it has: a restarted group has nothing);
2. load what a group lacks (`/v1/load_lora_adapter`). The engine's answer is kept per
   (adapter, group): a 400 is the adapter's own fault (rank, modules, base model: the same on
   every group) and is not retried until its path changes; anything else (a 404 for a path that
   is not there yet, no answer) is retried after RETRY_SECONDS;
3. send one request for each loaded adapter through the frontend Service (`max_tokens: 1`):
   Ready is reported only once the routers route it, so "Ready but 404" cannot be reported.

A pass never waits for an engine: it reads `view()` (what the task last saw) and `follow()`s
the groups and adapters it wants; a change of the view asks for a pass (`on_change`). Unloading
is the delete handler's (`unload`), awaited before the adapter's finalizer goes.

aiohttp, as drain_probe.py: it comes with kopf.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import aiohttp
from shoal.contract import lora

log = logging.getLogger("shoal.operator.adapter_sync")

SYNC_INTERVAL_SECONDS = 2.0
RETRY_SECONDS = 10.0
READ_TIMEOUT_SECONDS = 2.0
LOAD_TIMEOUT_SECONDS = 120.0  # reading and checking an adapter's weights in the engine
PROBE_TIMEOUT_SECONDS = 60.0  # one token through a frontend, behind whatever is queued
REPROBE_SECONDS = 60.0
# How long a delete waits for every frontend to stop listing the adapter (its routers re-read
# the groups' lists every 2 s), so that one made again under the name meets no stale list.
FRONTEND_DROP_SECONDS = 10.0
# A new group whose /v1/models does not answer is held this long before it counts as answered
# (a pod just Ready on a busy node can miss a 2 s read; a hold must still end).
NO_LIST_HOLD_SECONDS = 30.0


@dataclass(frozen=True)
class Answer:
    """What one group answered to loading one adapter from `path`."""

    ok: bool
    status: int  # HTTP status; 0: no answer
    message: str
    path: str
    at: float  # time.time(); for `unlisted`, the first time the list did not answer
    unlisted: bool = False  # no load was tried: the group's /v1/models did not answer

    @property
    def permanent(self) -> bool:
        return self.status == 400

    @property
    def reason(self) -> str:
        if self.ok:
            return "Loaded"
        return {400: "AdapterInvalid", 404: "AdapterNotFound"}.get(self.status,
                                                                  "EngineUnreachable")


@dataclass(frozen=True)
class Probe:
    ok: bool
    message: str
    groups: frozenset[int]  # the groups that had it loaded when it ran
    at: float


@dataclass(frozen=True)
class Want:
    """What a pass wants of one engine: its groups (group -> rank 0's base URL), its adapters
    (name -> path in the engine's containers), the frontend Service's base URL and the API keys
    the frontends and the engines expect (None: none)."""

    groups: Mapping[int, str]
    adapters: Mapping[str, str]
    service: str
    api_key: str | None = None
    engine_key: str | None = None


@dataclass(frozen=True)
class View:
    """What the task last saw of one engine: each group's loaded adapters (None: /v1/models did
    not answer), the answers per (adapter, group), the probes per adapter."""

    loaded: Mapping[int, frozenset[str] | None] = field(default_factory=dict)
    answers: Mapping[tuple[str, int], Answer] = field(default_factory=dict)
    probes: Mapping[str, Probe] = field(default_factory=dict)
    urls: Mapping[int, str] = field(default_factory=dict)  # group -> the rank 0 it was read from

    def of(self, groups: Mapping[int, str]) -> View:
        """Only what was read from these groups' current rank 0 (group -> base URL): a group
        restarted since (a new pod, another address) has nothing loaded and nothing answered
        yet, whatever its old pod had (found by benchmarks/lora_churn.py: a restarted group
        counted its old pod's adapters and was not held)."""
        same = {g for g, u in self.urls.items() if groups.get(g) == u}
        return View(loaded={g: n for g, n in self.loaded.items() if g in same},
                    answers={k: a for k, a in self.answers.items() if k[1] in same},
                    probes=self.probes, urls={g: self.urls[g] for g in same})

    def has(self, group: int, name: str) -> bool:
        return name in (self.loaded.get(group) or ())

    def answered(self, group: int, name: str, now: float | None = None) -> bool:
        """The group has it, or said why not (a new group is held until then); a group whose
        list did not answer counts only after NO_LIST_HOLD_SECONDS."""
        if self.has(group, name):
            return True
        a = self.answers.get((name, group))
        if a is None:
            return False
        if a.status == 0 and a.unlisted:
            return (now if now is not None else time.time()) - a.at >= NO_LIST_HOLD_SECONDS
        return True

    def groups_with(self, name: str) -> frozenset[int]:
        return frozenset(g for g, names in self.loaded.items() if name in (names or ()))


def _headers(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


class HTTP:
    """The engine and frontend calls (a class, so a test can hand in its own session)."""

    async def models(self, base: str, key: str | None = None) -> frozenset[str] | None:
        timeout = aiohttp.ClientTimeout(total=READ_TIMEOUT_SECONDS)
        try:
            async with aiohttp.ClientSession(timeout=timeout) as s, \
                    s.get(base + lora.MODELS_PATH, headers=_headers(key)) as r:
                if r.status != 200:
                    return None
                got = lora.listed(await r.text())
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return None
        return None if got is None else frozenset(got)

    async def post(self, url: str, body: dict, timeout: float,
                   key: str | None = None) -> tuple[int, str]:
        try:
            async with aiohttp.ClientSession(
                    timeout=aiohttp.ClientTimeout(total=timeout)) as s, \
                    s.post(url, json=body, headers=_headers(key)) as r:
                return r.status, (await r.text())[:2000]
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            return 0, f"no answer from {url}: {type(e).__name__} {e}".strip()


def _message(text: str) -> str:
    """An OpenAI error body's message, else the text."""
    try:
        data = json.loads(text)
        err = data.get("error") if isinstance(data, dict) else None
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(data, dict) and data.get("message"):  # vLLM's ErrorResponse
            return str(data["message"])
    except ValueError:
        pass
    return text.strip()


class AdapterSync:
    """One sync task per engine; `follow` and `view` are thread-safe (passes run in threads)."""

    def __init__(self, on_change: Callable[[tuple[str, str]], None], http: HTTP | None = None,
                 interval: float = SYNC_INTERVAL_SECONDS):
        self._on_change, self._http, self._interval = on_change, http or HTTP(), interval
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wants: dict[tuple[str, str], Want] = {}
        self._views: dict[tuple[str, str], View] = {}
        self._tasks: dict[tuple[str, str], asyncio.Task] = {}
        self._unloaded: dict[tuple[str, str, str], float] = {}  # (ns, engine, name) -> when
        self._lock = threading.Lock()

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    @property
    def bound(self) -> bool:
        return self._loop is not None

    def view(self, namespace: str, engine: str) -> View:
        """What the task last saw, without a probe made before its adapter was last unloaded
        (an adapter deleted and made again under its name is proven anew: the old one's probe
        had made it Ready before it was loaded; found by benchmarks/lora_churn.py)."""
        with self._lock:
            view = self._views.get((namespace, engine)) or View()
            gone = {n: at for (ns, e, n), at in self._unloaded.items()
                    if (ns, e) == (namespace, engine) and n in view.probes}
        if not gone:
            return view
        return replace(view, probes={n: p for n, p in view.probes.items()
                                     if p.at >= gone.get(n, float("-inf"))})

    def follow(self, namespace: str, engine: str, want: Want | None) -> None:
        """From now on keep these groups in sync with these adapters (None or nothing to do:
        stop, and forget the view)."""
        key = (namespace, engine)
        active = want is not None and bool(want.groups) and bool(want.adapters)
        with self._lock:
            if active:
                self._wants[key] = want
            else:
                self._wants.pop(key, None)
                self._views.pop(key, None)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._ensure, key)

    def _ensure(self, key: tuple[str, str]) -> None:
        with self._lock:
            wanted = key in self._wants
        task = self._tasks.get(key)
        if wanted and (task is None or task.done()):
            self._tasks[key] = asyncio.get_running_loop().create_task(self._run(key))
        elif not wanted and task is not None:
            task.cancel()
            self._tasks.pop(key, None)

    async def _run(self, key: tuple[str, str]) -> None:
        while True:
            with self._lock:
                want = self._wants.get(key)
            if want is None:
                return
            try:
                await self.sync_once(key, want)
            except Exception:  # noqa: BLE001 - a report; the next round tries again
                log.exception("%s/%s: adapter sync failed", *key)
            await asyncio.sleep(self._interval)

    async def sync_once(self, key: tuple[str, str], want: Want) -> View:
        """One round for one engine (the task's body; a test calls it directly)."""
        old = self.view(*key).of(want.groups)
        now = time.time()
        reads = await asyncio.gather(*(self._http.models(u, want.engine_key)
                                       for u in want.groups.values()))
        loaded = dict(zip(want.groups, reads, strict=True))
        answers = {k: a for k, a in old.answers.items()
                   if k[1] in want.groups and k[0] in want.adapters}
        for g, base in want.groups.items():
            for name, path in want.adapters.items():
                have = loaded[g]
                if have is not None and name in have:
                    answers.pop((name, g), None)
                    continue
                last = answers.get((name, g))
                if last is not None and last.path == path and not last.unlisted and (
                        last.permanent or now - last.at < RETRY_SECONDS):
                    continue
                if have is None:  # no list: held for a while, not for ever (View.answered)
                    first = last.at if last is not None and last.unlisted else now
                    answers[(name, g)] = Answer(False, 0, f"group {g}: {base}{lora.MODELS_PATH}"
                                                " did not answer", path, first, unlisted=True)
                    continue
                if self._unloaded_since(key, name, now):
                    continue  # deleted while this round ran: never loaded again
                answer = await self._load(g, base, name, path, want.engine_key)
                if answer.ok and self._unloaded_since(key, name, now) and \
                        not self._wanted_now(key, name, path):  # deleted meanwhile
                    await self._unload_one(base, name, want.engine_key)
                    log.info("adapter %s unloaded again from group %d: deleted while it "
                             "loaded", name, g)
                    continue
                if answer.ok:
                    loaded[g] = have | {name}
                    answers.pop((name, g), None)
                else:
                    answers[(name, g)] = answer
        probes = await self._probes(key, want, old, loaded, now)
        view = View(loaded=loaded, answers=answers, probes=probes, urls=dict(want.groups))
        with self._lock:
            if key not in self._wants:  # unfollowed meanwhile
                return view
            self._views[key] = view
        if _summary(view) != _summary(old):
            self._on_change(key)
        return view

    async def _load(self, group: int, base: str, name: str, path: str,
                    key: str | None) -> Answer:
        t0 = time.monotonic()
        status, text = await self._http.post(base + lora.LOAD_PATH,
                                             {"lora_name": name, "lora_path": path},
                                             LOAD_TIMEOUT_SECONDS, key)
        ok = status == 200 or (status == 400 and "already been loaded" in text)
        message = _message(text)
        if ok:
            log.info("adapter %s loaded on group %d from %s in %.2fs", name, group, path,
                     time.monotonic() - t0)
        else:
            log.warning("adapter %s on group %d: %s %s", name, group, status or "no answer",
                        message)
        return Answer(ok, status, "" if ok else message, path, time.time())

    async def _probes(self, key, want: Want, old: View, loaded: dict, now: float) -> dict:
        out = {}
        for name in want.adapters:
            on = frozenset(g for g, names in loaded.items() if name in (names or ()))
            last = old.probes.get(name)
            if not on:
                continue
            fresh = last is not None and last.ok and last.groups == on and (
                now - last.at < REPROBE_SECONDS)
            if fresh:
                out[name] = last
                continue
            if self._unloaded_since(key, name, now):
                continue  # deleted while this round ran: its probe would meet stale lists
            status, text = await self._http.post(
                want.service + "/v1/completions",
                {"model": name, "prompt": "Hello", "max_tokens": 1}, PROBE_TIMEOUT_SECONDS,
                want.api_key)
            ok = status == 200
            message = ("a completion through the frontend Service succeeded" if ok else
                       f"a completion through the frontend Service answered "
                       f"{status or 'nothing'}: {_message(text)}")
            if ok != (last.ok if last else None):
                log.info("%s/%s adapter %s: %s", *key, name, message)
            out[name] = Probe(ok, message, on, now)
        return out

    async def _unload_one(self, base: str, name: str, key: str | None) -> tuple[int, str]:
        return await self._http.post(base + lora.UNLOAD_PATH, {"lora_name": name},
                                     READ_TIMEOUT_SECONDS * 5, key)

    def _wanted_now(self, key: tuple[str, str], name: str, path: str) -> bool:
        """Whether `name` from `path` is wanted again (deleted and made again while a load of
        it ran: that load is the new adapter's, and unloading it would take it from under the
        requests its creation let in; found by benchmarks/lora_churn.py)."""
        with self._lock:
            want = self._wants.get(key)
        return want is not None and want.adapters.get(name) == path

    def _unloaded_since(self, key: tuple[str, str], name: str, since: float) -> bool:
        with self._lock:
            return self._unloaded.get((*key, name), float("-inf")) >= since

    async def unload(self, namespace: str, engine: str, name: str,
                     frontends: list[str] = ()) -> list[str]:
        """Unload one adapter from every group it is followed on, then wait (at most
        FRONTEND_DROP_SECONDS) until none of the `frontends` (base URLs) lists it; the
        failures, each naming its group (a group that no longer has it counts as done)."""
        now = time.time()
        with self._lock:
            self._unloaded = {k: at for k, at in self._unloaded.items()
                              if now - at < REPROBE_SECONDS * 5}
            self._unloaded[(namespace, engine, name)] = now
            want = self._wants.get((namespace, engine))
            if want is not None:  # no more loads of it meanwhile
                adapters = {k: v for k, v in want.adapters.items() if k != name}
                self._wants[(namespace, engine)] = replace(want, adapters=adapters)
        if want is None:
            return []
        errors = []
        for g, base in want.groups.items():
            status, text = await self._unload_one(base, name, want.engine_key)
            if status not in (200, 404):
                errors.append(f"group {g}: {status or 'no answer'} {_message(text)}")
            else:
                log.info("adapter %s unloaded from group %d of %s/%s", name, g, namespace,
                         engine)
        # also after a failed unload (a group that died comes back without it; the routers
        # drop it when they read the others' lists: lora_churn found a kill during a delete)
        await self._until_dropped(f"{namespace}/{engine}", name, frontends, want.api_key)
        return errors

    async def _until_dropped(self, engine: str, name: str, frontends: list[str],
                             key: str | None) -> None:
        """Until no frontend's /v1/models lists `name` (its routers read the groups' lists
        again): a request for an adapter made again under the name is then never sent on a
        list from before the unload, to a group without it (benchmarks/lora_churn.py)."""
        t0 = time.monotonic()
        left = list(frontends)
        while left and time.monotonic() - t0 < FRONTEND_DROP_SECONDS:
            reads = await asyncio.gather(*(self._http.models(u, key) for u in left))
            left = [u for u, names in zip(left, reads, strict=True)
                    if names is None or name in names]
            if left:
                await asyncio.sleep(0.25)
        if left:
            log.warning("adapter %s of %s: still listed by (or no answer from) frontends %s "
                        "after %.0f s; deleting it anyway", name, engine, ", ".join(left),
                        FRONTEND_DROP_SECONDS)
        elif frontends:
            log.info("adapter %s of %s: no frontend lists it (%.1f s after the unload)", name,
                     engine, time.monotonic() - t0)


def _summary(view: View) -> tuple:
    """What a pass reports from a view: a change asks for one (retries at the same answer and
    re-probes with the same result do not)."""
    return (tuple(sorted((g, tuple(sorted(n)) if n is not None else None)
                         for g, n in view.loaded.items())),
            tuple(sorted((k, a.status, a.message) for k, a in view.answers.items())),
            tuple(sorted((n, p.ok, tuple(sorted(p.groups))) for n, p in view.probes.items())))
