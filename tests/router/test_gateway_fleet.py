"""The fleet gateway against real `shoal serve` groups of two models, discovering them from the
discovery data the operator's `render` produces (one ENGINE.json per InferenceEngine; the
test plays cluster DNS by pointing each rendered rank-0 address at the local engine).

Models: `alpha` (engine alpha, groups 0 and 1) and `beta` (engine beta, group 0). Order: the
non-destructive tests first; then an engine dying before any output (retried on the other
group), a group that comes back, and a dead engine that fails only its own model's requests.
"""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import openai
import pytest
from router_helpers import (
    API_KEY,
    GatewayProcess,
    ServeProcess,
    chat_with_system,
    engine_successes,
    kill_group,
    local_discovery,
    prefix_cache,
    write_atomically,
)
from shoal.contract import discovery
from shoal.operator import labels as L
from shoal.operator import render
from shoal.operator.spec import parse
from support.wait import wait_for

pytestmark = pytest.mark.process  # real processes and sockets (tests/conftest.py)


def _body(name: str, replicas: int) -> dict:
    return {"apiVersion": L.API_VERSION, "kind": L.KIND,
            "metadata": {"name": name, "namespace": "prod", "uid": f"uid-{name}"},
            "spec": {"model": "/models/tiny", "servedModelName": name, "replicas": replicas}}


def _serve(tiny_model, tmp, name: str, port: int | None = None) -> ServeProcess:
    flags = ["--max-model-len", "2048", "--served-model-name", name]
    e = ServeProcess(tiny_model, tmp, *flags, *(["--port", str(port)] if port else []),
                     api_key=API_KEY)
    if port:
        e.port = port
    return e


@pytest.fixture(scope="module")
def fleet(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fleet")
    engines = {"alpha": {0: _serve(tiny_model, tmp, "alpha"), 1: _serve(tiny_model, tmp, "alpha")},
               "beta": {0: _serve(tiny_model, tmp, "beta")}}
    try:
        for groups in engines.values():
            for e in groups.values():
                e.wait_healthy()
        yield tmp, engines
    finally:
        for groups in engines.values():
            for e in groups.values():
                e.stop()


@pytest.fixture(scope="module")
def discovery_dir(fleet):
    tmp, engines = fleet
    d = tmp / "discovery"
    d.mkdir()
    for name, groups in engines.items():
        rendered = render.discovery_data(*parse(_body(name, len(groups))), list(groups))
        write_atomically(d / f"{name}.json", local_discovery(rendered[discovery.KEY], groups))
    return d


@pytest.fixture(scope="module")
def gateway(fleet, discovery_dir):
    tmp, _ = fleet
    gw = GatewayProcess(tmp, "--discovery-dir", str(discovery_dir))
    try:
        yield gw.wait_listening()
    finally:
        rc = gw.stop()
    assert rc == 0, f"the gateway exited with {rc} after SIGTERM:\n{gw.log()[-2000:]}"


def _complete(gw, model: str, n: int = 1, **extra) -> list[httpx.Response]:
    out = []
    for _ in range(n):
        r = httpx.post(f"{gw.url}/v1/completions", headers=gw.headers, timeout=60,
                       json={"model": model, "prompt": "hello", "max_tokens": 2, **extra})
        assert r.status_code == 200, r.text
        out.append(r)
    return out


def _successes(engines) -> dict:
    return {(m, g): engine_successes(e) for m, groups in engines.items() for g, e in groups.items()}


def _client(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_models_lists_every_served_model(gateway):
    assert [m.id for m in _client(gateway).models.list().data] == ["alpha", "beta"]
    assert "engine alpha: model alpha, 2 ready group(s)" in gateway.log()


def test_requests_go_to_their_models_groups(gateway, fleet):
    _, engines = fleet
    before = _successes(engines)
    _complete(gateway, "alpha", 4)
    _complete(gateway, "beta", 3)
    after = _successes(engines)
    assert {k: after[k] - before[k] for k in after} == {("alpha", 0): 2, ("alpha", 1): 2,
                                                        ("beta", 0): 3}
    client = _client(gateway)
    chunks = list(client.completions.create(model="beta", prompt="Once upon", max_tokens=5,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert {c.model for c in chunks} == {"beta"}
    assert len([c for c in chunks if c.choices and c.choices[0].text]) >= 2
    chat = client.chat.completions.create(model="alpha", max_tokens=3,
                                          messages=[{"role": "user", "content": "hi"}],
                                          extra_body={"ignore_eos": True})
    assert chat.model == "alpha" and chat.usage.completion_tokens == 3


def test_unknown_model_is_openais_404_naming_the_models(gateway):
    before = gateway.metrics()
    with pytest.raises(openai.NotFoundError) as err:
        _client(gateway).completions.create(model="gamma", prompt="hi", max_tokens=1)
    body = err.value.body
    assert body["type"] == "NotFoundError" and body["code"] == 404
    assert "`gamma` does not exist" in body["message"] and "alpha, beta" in body["message"]
    after = gateway.metrics()  # nothing was forwarded
    assert {k: v for k, v in after.items() if k.startswith("shoal_router_requests")} == \
        {k: v for k, v in before.items() if k.startswith("shoal_router_requests")}


def test_metrics_sum_the_groups_per_model_with_vllms_names(gateway, fleet):
    _, engines = fleet
    _complete(gateway, "alpha", 2)
    _complete(gateway, "beta", 1)

    def engine_total(e) -> float:
        return e.metric("vllm:request_success_total", 'finished_reason="length"')

    want = {m: sum(engine_total(e) for e in groups.values()) for m, groups in engines.items()}
    got = gateway.metrics()
    for model, total in want.items():
        key = ('vllm:request_success_total{engine="0",finished_reason="length",'
               f'model_name="{model}"}}')
        assert got[key] == total
        assert f'vllm:num_requests_waiting{{engine="0",model_name="{model}"}}' in got
    assert got['shoal_router_groups_listed'] == 3


SYSTEM_A = "You are the billing team's assistant: answer in one short sentence. " * 24
SYSTEM_B = "You are the shipping team's assistant: answer with a tracking hint. " * 24


def _shared_prefix_run(gw, engines, system: str, n: int = 8) -> tuple[dict, float]:
    """n chats with one system prompt, one at a time: requests served per alpha group, and the
    groups' prefix-cache hit rate over them (their own vllm:prefix_cache_* counters)."""
    groups = engines["alpha"]
    before = {g: (engine_successes(e), *prefix_cache(e)) for g, e in groups.items()}
    for i in range(n):
        chat_with_system(gw.url, gw.headers, "alpha", system, f"What about invoice {i}?")
    after = {g: (engine_successes(e), *prefix_cache(e)) for g, e in groups.items()}
    served = {g: after[g][0] - before[g][0] for g in groups}
    hits = sum(after[g][1] - before[g][1] for g in groups)
    queries = sum(after[g][2] - before[g][2] for g in groups)
    return served, hits / queries


def test_prefix_affinity_keeps_a_shared_prefix_on_one_group(gateway, fleet, discovery_dir):
    tmp, engines = fleet
    affinity = GatewayProcess(tmp, "--discovery-dir", str(discovery_dir),
                              "--routing", "prefix-affinity")
    try:
        affinity.wait_listening()
        wait_for(lambda: affinity.metrics().get("shoal_router_groups_usable") == 3, 10,
                 what="the second gateway to see every group")
        served, rate = _shared_prefix_run(affinity, engines, SYSTEM_A)
    finally:
        assert affinity.stop() == 0
    assert sorted(served.values()) == [0, 8], served
    # The same workload (another system prompt) under least-outstanding alternates groups, so
    # each group computes the prompt once: fewer of the prompt tokens come from a cache.
    spread, base = _shared_prefix_run(gateway, engines, SYSTEM_B)
    assert sorted(spread.values()) == [4, 4], spread
    assert rate > base > 0, (rate, base)


def _stream(gw, model: str, out: dict) -> None:
    with httpx.stream("POST", f"{gw.url}/v1/completions", headers=gw.headers, timeout=60,
                      json={"model": model, "prompt": "hi", "max_tokens": 8, "ignore_eos": True,
                            "stream": True, "stream_options": {"include_usage": True}}) as r:
        out["status"] = r.status_code
        out["body"] = b"".join(r.iter_raw()).decode()


def _plain(gw, model: str, out: dict) -> None:
    r = httpx.post(f"{gw.url}/v1/completions", headers=gw.headers, timeout=60,
                   json={"model": model, "prompt": "hi", "max_tokens": 4, "ignore_eos": True})
    out["status"], out["body"] = r.status_code, r.text


def _stuck_on(gw, label: str, send) -> tuple[threading.Thread, dict, int]:
    """Send requests (each in a thread) until one waits on group `label`, whose EngineCore is
    frozen; those that land on the healthy group just finish. (thread, its result, sent)."""
    key = f'shoal_router_outstanding_requests{{group="{label}"}}'
    for sent in range(1, 21):
        out: dict = {}
        t = threading.Thread(target=send, args=(gw, "alpha", out))
        t.start()
        wait_for(lambda t=t: gw.metrics().get(key) == 1 or not t.is_alive(), 10,
                 what="the request to finish or to wait on the frozen group")
        if t.is_alive():
            return t, out, sent
    raise AssertionError(f"no request was sent to {label}")


def _upstream_errors(gw, label: str) -> dict[str, float]:
    """shoal_router_upstream_errors_total of one group, by cause."""
    prefix = "shoal_router_upstream_errors_total{"
    return {k.split('cause="', 1)[1].split('"', 1)[0]: v for k, v in gw.metrics().items()
            if k.startswith(prefix) and f'group="{label}"' in k}


def _die_before_output(gw, engines, g: int, send) -> tuple[dict, set[str]]:
    """Freeze alpha group `g`'s EngineCore (SIGSTOP) until a request waits on it with no output,
    then kill it (its server fails the request before any token); the gateway's answer and the
    causes it counted for that group."""
    victim, other = engines["alpha"][g], engines["alpha"][1 - g]
    core = victim.engine_pid()
    os.kill(core, signal.SIGSTOP)
    try:
        retries = gw.metrics().get("shoal_router_retries_total", 0)
        errors = _upstream_errors(gw, f"alpha/{g}")
        before = engine_successes(other)
        t, out, sent = _stuck_on(gw, f"alpha/{g}", send)
    finally:
        os.kill(core, signal.SIGKILL)
    t.join(60)
    assert gw.metrics()["shoal_router_retries_total"] == retries + 1
    assert engine_successes(other) == before + sent  # the stuck one was served there too
    counted = {c for c, v in _upstream_errors(gw, f"alpha/{g}").items() if v > errors.get(c, 0)}
    assert counted, "the failure is counted against the group that failed"
    assert f"; retrying on engine alpha group {1 - g}" in gw.log()  # one line names the retry
    victim.wait_exit(30)
    return out, counted


def _bring_back(gw, engines, g: int, tmp, tiny_model) -> None:
    """Start group `g` again at its address: the gateway sends to it again."""
    back = _serve(tiny_model, tmp, "alpha", port=engines["alpha"][g].port).wait_healthy()
    engines["alpha"][g] = back
    wait_for(lambda: gw.log().count(f"engine alpha group {g} recovered") >= 1, 15,
             what=f"the gateway to see group {g} again", detail=lambda: gw.log()[-1500:])
    wait_for(lambda: gw.metrics().get("shoal_router_groups_usable") == 3, 10,
             what="every group usable again")
    before = engine_successes(back)
    _complete(gw, "alpha", 4)
    assert engine_successes(back) == before + 2


def test_a_stream_whose_engine_dies_before_any_token_is_retried(gateway, fleet, tiny_model):
    tmp, engines = fleet
    out, causes = _die_before_output(gateway, engines, 0, _stream)
    assert out["status"] == 200
    assert '"error"' not in out["body"] and out["body"].endswith("data: [DONE]\n\n")
    # Every token arrived (a loaded engine may put several tokens in one chunk).
    assert '"completion_tokens":8' in out["body"].replace(" ", ""), out["body"][-400:]
    assert causes <= {"no_output", "server_error"}, causes  # failed before any output
    _bring_back(gateway, engines, 0, tmp, tiny_model)


def test_a_request_whose_engine_dies_before_answering_is_retried(gateway, fleet, tiny_model):
    tmp, engines = fleet
    out, causes = _die_before_output(gateway, engines, 1, _plain)
    assert out["status"] == 200, out["body"]
    assert json.loads(out["body"])["usage"]["completion_tokens"] == 4
    assert causes <= {"server_error", "no_answer", "no_output"}, causes
    _bring_back(gateway, engines, 1, tmp, tiny_model)


def test_streamed_output_is_never_retried(gateway, fleet):
    """An alpha group killed after its stream produced tokens: a 502 error event naming the
    engine and group, and no second try on the other group."""
    _, engines = fleet
    retries = gateway.metrics().get("shoal_router_retries_total", 0)
    before = {g: engine_successes(e) for g, e in engines["alpha"].items()}
    with httpx.stream("POST", f"{gateway.url}/v1/completions", headers=gateway.headers,
                      timeout=60, json={"model": "alpha", "prompt": "hi", "max_tokens": 1500,
                                        "ignore_eos": True, "stream": True}) as r:
        chunks = r.iter_raw()
        first = next(chunks)
        victim = next(g for g in engines["alpha"] if gateway.metrics().get(
            f'shoal_router_outstanding_requests{{group="alpha/{g}"}}') == 1)
        kill_group(engines["alpha"][victim])
        rest = (first + b"".join(chunks)).decode()
    url = engines["alpha"][victim].url
    assert f"engine alpha group {victim} ({url}) failed mid-stream" in rest, rest[-400:]
    assert '"code": 502' in rest and rest.endswith("data: [DONE]\n\n")
    assert gateway.metrics().get("shoal_router_retries_total", 0) == retries
    other = 1 - victim
    assert engine_successes(engines["alpha"][other]) == before[other]


def test_a_dead_engine_fails_only_its_own_models_requests(gateway, fleet):
    """Beta's only group is killed: beta gets 503 naming engine and group; alpha (one group
    left after the previous test) still serves."""
    _, engines = fleet
    kill_group(engines["beta"][0])
    r = httpx.post(f"{gateway.url}/v1/completions", headers=gateway.headers, timeout=30,
                   json={"model": "beta", "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 503, r.text
    message = r.json()["error"]["message"]
    assert message.startswith("no engine group is ready")
    assert f"engine beta group 0 ({engines['beta'][0].url})" in message
    assert "alpha" not in message
    _complete(gateway, "alpha", 4)
    assert httpx.get(f"{gateway.url}/health", timeout=5).status_code == 200
    models = httpx.get(f"{gateway.url}/v1/models", headers=gateway.headers, timeout=5).json()
    assert [m["id"] for m in models["data"]] == ["alpha", "beta"]  # listed: still Ready to k8s
