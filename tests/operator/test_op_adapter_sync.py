"""The operator's adapter sync against real parts: a `shoal serve --enable-lora` group (rank 0)
with runtime loading on, a real `shoal router` in front as the frontend Service, and adapters
made with the real `peft`. What the engine answers is what the operator's status is made of:
a loaded adapter, one refused for good (rank above --max-lora-rank), one whose path is not
there (retried); the probe through the router; the unload."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
from shoal.contract import lora
from shoal.operator.adapter_spec import Adapter, engine_path
from shoal.operator.adapter_status import adapter_status
from shoal.operator.adapter_sync import AdapterSync, Want
from shoal.operator.spec import parse
from support.builders import engine as engine_body
from support.servers import API_KEY, MODEL_NAME, ServeProcess
from support.stand_in_hub import make_server
from support.wait import wait_for

from tests.engine import lora_peft
from tests.router.router_helpers import RouterProcess, write_discovery

pytestmark = pytest.mark.process
KEY = ("prod", "llm")


@pytest.fixture(scope="module")
def made(tiny_model, tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("sync-lora")
    return {"sql": lora_peft.make_adapter(tiny_model, d / "sql", 41, r=4),
            "wide": lora_peft.make_adapter(tiny_model, d / "wide", 42, r=16),
            "missing": str(d / "not-there")}


@pytest.fixture(scope="module")
def hub(made, tmp_path_factory):
    """The stand-in hub (support/stand_in_hub.py; no real hub is reachable here) serving the
    adapter `sql` as the repository shoal/sql-lora; the client is the real huggingface_hub."""
    root = tmp_path_factory.mktemp("adapter-hub")
    (root / "shoal").mkdir()
    (root / "shoal" / "sql-lora").symlink_to(made["sql"])
    server = make_server(root, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def stack(tiny_model, hub, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sync-stack")
    engine = ServeProcess(tiny_model, tmp, "--enable-lora", "--max-loras", "2",
                          "--max-lora-rank", "8", "--max-model-len", "512",
                          "--download-dir", str(tmp / "hub-cache"),
                          env={lora.RUNTIME_UPDATES_ENV: "true", "HF_ENDPOINT": hub},
                          api_key=API_KEY)
    router = None
    try:
        engine.wait_healthy()
        path = tmp / "engines.json"
        write_discovery(path, {0: engine})
        router = RouterProcess(tiny_model, path, tmp).wait_listening()
        yield engine, router
    finally:
        if router is not None:
            router.stop()
        engine.stop()


def _adapter(name: str, source: str) -> Adapter:
    return Adapter.of({"metadata": {"name": name, "namespace": "prod", "uid": f"u-{name}",
                                    "generation": 1},
                       "spec": {"engine": "llm", "source": source}})


def _status(name: str, source: str, view) -> dict:
    return adapter_status(_adapter(name, source), problem="", path=source, serving=[0],
                          view=view, now="2026-12-02T00:00:00Z")


def test_load_probe_and_unload_against_a_real_engine_and_router(stack, made):
    engine, router = stack
    changes = []
    sync = AdapterSync(on_change=changes.append)
    want = Want(groups={0: engine.url}, adapters=dict(made), service=router.url,
                api_key=API_KEY, engine_key=API_KEY)
    sync.follow(*KEY, want)  # not bound to a loop: the rounds below are run by hand

    view = asyncio.run(sync.sync_once(KEY, want))
    assert view.has(0, "sql") and changes == [KEY]
    wide, missing = view.answers[("wide", 0)], view.answers[("missing", 0)]
    assert wide.status == 400 and wide.permanent and wide.reason == "AdapterInvalid"
    assert "rank" in wide.message and "16" in wide.message and "8" in wide.message
    assert missing.status == 404 and not missing.permanent
    assert missing.reason == "AdapterNotFound" and "not-there" in missing.message
    # every adapter answered: a new group would no longer be held for any of them
    assert all(view.answered(0, n) for n in made)

    # Ready only once the router routes it (its health prober reads the engine's /v1/models)
    def probed():
        v = asyncio.run(sync.sync_once(KEY, want))
        return v if v.probes["sql"].ok else None

    view = wait_for(probed, timeout=30, interval=0.5, what="the probe through the router")
    st = _status("sql", made["sql"], view)
    assert (st["phase"], st["loaded"], st["loadedGroups"]) == ("Ready", "1/1", [0])
    bad = _status("wide", made["wide"], view)
    assert bad["phase"] == "Failed" and bad["lastError"]["permanent"] is True
    assert "wide" not in view.probes  # never loaded: never probed
    # the refusal is not retried: the engine is asked once
    again = asyncio.run(sync.sync_once(KEY, want))
    assert again.answers[("wide", 0)].at == wide.at

    out = httpx.post(f"{router.url}/v1/completions", timeout=60,
                     headers={"Authorization": f"Bearer {API_KEY}"},
                     json={"model": "sql", "prompt": "Hello", "max_tokens": 2})
    assert out.status_code == 200, out.text

    # the delete returns once the frontend no longer lists it (its prober read the engine)
    assert asyncio.run(sync.unload(*KEY, "sql", frontends=[router.url])) == []
    for base in (engine.url, router.url):
        listed = httpx.get(f"{base}{lora.MODELS_PATH}", timeout=10,
                           headers={"Authorization": f"Bearer {API_KEY}"}).text
        assert "sql" not in lora.listed(listed) and MODEL_NAME in listed, base
    # an adapter made again under the name is not Ready on the old one's probe
    assert "sql" not in sync.view(*KEY).probes
    st = _status("sql", made["sql"], sync.view(*KEY))
    assert st["phase"] != "Ready", st


def test_an_hf_source_is_downloaded_by_the_engine_from_the_hub(stack, hub):
    engine, router = stack
    spec = parse(engine_body().set(lora={}).obj())[1]
    path, problem = engine_path(_adapter("hubsql", "hf://shoal/sql-lora"), spec)
    assert (path, problem) == ("shoal/sql-lora", "")  # vLLM's load endpoint takes a repo id
    want = Want(groups={0: engine.url}, adapters={"hubsql": path, "nope": "shoal/no-such-lora"},
                service=router.url, api_key=API_KEY, engine_key=API_KEY)
    sync = AdapterSync(on_change=lambda key: None)
    sync.follow(*KEY, want)
    view = asyncio.run(sync.sync_once(KEY, want))
    assert view.has(0, "hubsql")
    nope = view.answers[("nope", 0)]
    assert nope.status == 404 and not nope.permanent and "no such repository" in nope.message
    out = httpx.post(f"{engine.url}/v1/completions", timeout=60,
                     headers={"Authorization": f"Bearer {API_KEY}"},
                     json={"model": "hubsql", "prompt": "Hello", "max_tokens": 2})
    assert out.status_code == 200, out.text


class _Engines:
    """Two groups' endpoints as the sync calls them (a recording stand-in for the HTTP class:
    the interleaving below cannot be forced on real engines): a load on group 0 waits for
    `release`."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.loading = asyncio.Event()
        self.release = asyncio.Event()

    async def models(self, base, key=None):
        return frozenset()

    async def post(self, url, body, timeout, key=None):
        self.calls.append((url, body.get("lora_name") or body.get("model")))
        if url == "http://g0" + lora.LOAD_PATH:
            self.loading.set()
            await self.release.wait()
        return 200, "{}"


def _round_across_a_delete(made_again: bool):
    """A sync round whose load on group 0 is in flight when the adapter is deleted (and, if
    `made_again`, created again from the same source) before that load returns: the calls the
    engines saw and the round's view."""
    engines = _Engines()
    sync = AdapterSync(on_change=lambda key: None, http=engines)
    want = Want(groups={0: "http://g0", 1: "http://g1"}, adapters={"sql": "/a/sql"},
                service="http://svc")
    sync.follow(*KEY, want)

    async def scenario():
        round_ = asyncio.ensure_future(sync.sync_once(KEY, want))
        await engines.loading.wait()  # group 0's load is in flight
        assert await sync.unload(*KEY, "sql") == []
        if made_again:
            sync.follow(*KEY, want)  # made again under its name, from the same source
        engines.release.set()
        return await round_

    view = asyncio.run(scenario())
    return engines.calls, view


def test_an_adapter_deleted_during_a_round_is_not_loaded_or_probed_by_that_round():
    calls, view = _round_across_a_delete(made_again=False)
    assert calls == [
        ("http://g0" + lora.LOAD_PATH, "sql"),  # in flight when the delete came
        ("http://g0" + lora.UNLOAD_PATH, "sql"), ("http://g1" + lora.UNLOAD_PATH, "sql"),
        ("http://g0" + lora.UNLOAD_PATH, "sql"),  # what that load left, unloaded again
    ]  # no load on group 1 and no probe through the Service after the delete
    assert "sql" not in view.probes and not view.has(0, "sql")


def test_a_load_in_flight_across_a_delete_and_a_new_create_is_kept_for_the_new_adapter():
    """Deleted and made again (same source) while a round's load of it ran: the load is the new
    adapter's; unloading it again took it from under requests (lora_churn, 1,000 operations)."""
    calls, view = _round_across_a_delete(made_again=True)
    assert calls == [
        ("http://g0" + lora.LOAD_PATH, "sql"),
        ("http://g0" + lora.UNLOAD_PATH, "sql"), ("http://g1" + lora.UNLOAD_PATH, "sql"),
    ]  # the load that returned after the new create is kept: no third unload
    assert view.has(0, "sql") and "sql" not in view.probes  # proven by the next round
