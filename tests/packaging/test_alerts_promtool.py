"""The chart's alerts under `promtool test rules` (Debian's prometheus package): each alert
firing when it should and silent when it should not, at the chart's default thresholds.

The input series are the real ones: names, labels and histogram buckets from a real
`shoal serve` and a real `shoal router` (scraped here), labelled by the shipped scrape
configuration as the pods the operator renders would be; the operator's series are what the
real `shoal.operator.metrics` makes of a timeline of statuses, step by step."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import pytest
from alert_rules import (
    Expected,
    exported,
    operator_series,
    promtool_test,
    rules_text,
    scraped,
    series,
)
from support.builders import engine
from support.net import free_port
from support.prometheus_tools import PrometheusMissing, ensure_prometheus
from support.servers import MODEL_NAME, ServeProcess, ServerProcess
from support.wait import wait_for

pytestmark = pytest.mark.process  # real processes (promtool, shoal serve, shoal router)

NS, NAME = "prod", "llm"


@pytest.fixture(scope="module")
def promtool():
    try:
        return ensure_prometheus().promtool
    except PrometheusMissing as e:
        pytest.fail(f"promtool is needed for the alert tests: {e}", pytrace=False)


@pytest.fixture(scope="module")
def rules(helm_template) -> str:
    return rules_text(helm_template)


class Router(ServerProcess):
    """`shoal router` (an engine's frontend) on a discovery file."""

    def __init__(self, model: str, discovery, tmp) -> None:
        self.port = free_port()
        args = [sys.executable, "-m", "shoal.cli", "router", "--model", model,
                "--engine-discovery-file", str(discovery), "--host", "127.0.0.1",
                "--port", str(self.port), "--served-model-name", MODEL_NAME]
        super().__init__(args, tmp / "router.log", dict(os.environ), None)


@pytest.fixture(scope="module")
def expositions(tiny_model, tmp_path_factory) -> dict[str, str]:
    """The /metrics text of a real engine (after a request) and of a real frontend routing to
    it (after it found the group usable)."""
    tmp = tmp_path_factory.mktemp("alerts-scrape")
    eng = ServeProcess(tiny_model, tmp, "--max-model-len", "512")
    router = None
    try:
        eng.wait_healthy()
        r = httpx.post(f"{eng.url}/v1/completions", timeout=60,
                       json={"prompt": "hello", "max_tokens": 2})
        assert r.status_code == 200, r.text
        (tmp / "engines.json").write_text(
            f'{{"groups": [{{"group": 0, "url": "{eng.url}"}}], "model": "{MODEL_NAME}"}}')
        router = Router(tiny_model, tmp / "engines.json", tmp)
        router.wait_answering("/version", "the router to listen", 60)

        def usable() -> str | None:
            text = httpx.get(f"{router.url}/metrics", timeout=5).text
            return text if "shoal_router_groups_usable 1.0" in text else None

        frontend = wait_for(usable, timeout=30, interval=0.2,
                            what="the router to find the group usable")
        return {"engine": httpx.get(f"{eng.url}/metrics", timeout=10).text,
                "frontend": frontend}
    finally:
        if router is not None:
            router.stop()
        eng.stop()


@dataclass
class World:
    """The rendered pods the series come from, and the real expositions."""

    expositions: dict[str, str]
    operator_pod: dict

    def engine(self, startup_timeout: int = 1200):
        from shoal.operator.spec import parse

        body = engine(NAME, NS).groups(1).engine(startupTimeoutSeconds=startup_timeout).obj()
        return parse(body)

    def rank0(self) -> dict:
        from shoal.operator import render

        return {**render.engine_pod(*self.engine(), 0, 0)}

    def frontend_pod(self) -> dict:
        from shoal.operator import render

        tpl = render.frontend_deployment(*self.engine())["spec"]["template"]
        meta = {**tpl["metadata"], "name": f"{NAME}-frontend-7d9f8-x2x4q", "namespace": NS}
        return {"metadata": meta, "spec": tpl["spec"]}

    def real(self, component: str, name: str, job: str, pod: dict, values: str,
             where: Callable[[dict], bool] = lambda labels: True) -> list[dict]:
        """Input series for every label set the component really exports under `name`."""
        found = exported(self.expositions[component]).get(name)
        assert found, f"{component} exports no {name}"
        return [{"series": series(name, scraped(job, pod, labels)), "values": values}
                for labels in found if where(labels)]

    def vllm(self, name: str, values: str, where=lambda labels: True) -> list[dict]:
        return self.real("engine", name, "shoal-engines", self.rank0(), values, where)

    def router(self, name: str, values: str) -> list[dict]:
        return self.real("frontend", name, "shoal-frontends", self.frontend_pod(), values)

    def operator(self, timeline, until: float, step: float = 15, startup_timeout: int = 1200,
                 stale_after: bool = False) -> list[dict]:
        out = operator_series(timeline, *self.engine(startup_timeout), self.operator_pod,
                              step, until)
        if stale_after:  # the operator's target goes away after the timeline
            out = [{**s, "values": s["values"] + " stale"} for s in out]
        return out


@pytest.fixture(scope="module")
def world(expositions, helm_template) -> World:
    (dep,) = [o for o in helm_template() if o["kind"] == "Deployment"
              and o["metadata"]["labels"]["app.kubernetes.io/component"] == "operator"]
    tpl = dep["spec"]["template"]
    pod = {"metadata": {**tpl["metadata"], "name": "shoal-operator-5c6d7-abcde",
                        "namespace": "shoal-system"}, "spec": tpl["spec"]}
    return World(expositions, pod)


def status(*groups: tuple[str, int], replicas: int | None = None, restart_count: int = 0) -> dict:
    """An InferenceEngine status as the operator writes it: (phase, restarts) per group."""
    desired = len(groups) if replicas is None else replicas
    ready = sum(1 for p, _ in groups if p == "Ready")
    return {"phase": "Ready" if ready == desired and desired else "Progressing",
            "replicas": desired, "readyReplicas": ready, "restartCount": restart_count,
            "groups": [{"index": i, "phase": p, "restarts": r} for i, (p, r) in enumerate(groups)]}


GROUP = {"namespace": NS, "inference_engine": NAME, "engine_group": "0"}
ENGINE = {"namespace": NS, "inference_engine": NAME}
READY, STARTING, BACKING_OFF, FAILED = "Ready", "Starting", "BackingOff", "Failed"


@dataclass
class Case:
    name: str
    alert: str
    at: str
    input: Callable[[World], list[dict]]
    expect: list[Expected]
    interval: str = "15s"


CASES = [
    # -- an engine group down (the e2e tier kills one: tests/e2e/test_e2e_alerts.py)
    Case("a group that died and is not Ready again for 1m is down", "ShoalEngineGroupDown",
         "2m15s", lambda w: w.operator([(0, status((READY, 0))), (60, status((BACKING_OFF, 1))),
                                        (100, status((STARTING, 1)))], until=300),
         [Expected(GROUP)]),
    Case("the down group resolves once it is Ready again", "ShoalEngineGroupDown", "3m15s",
         lambda w: w.operator([(0, status((READY, 0))), (60, status((BACKING_OFF, 1))),
                               (100, status((STARTING, 1))), (180, status((READY, 1)))],
                              until=300), []),
    Case("a group that died and was Ready again within the minute never fired",
         "ShoalEngineGroupDown", "2m30s",
         lambda w: w.operator([(0, status((READY, 0))), (60, status((BACKING_OFF, 1))),
                               (105, status((READY, 1)))], until=300), []),
    Case("a new group starting is not down", "ShoalEngineGroupDown", "10m",
         lambda w: w.operator([(0, status((STARTING, 0)))], until=600), []),
    Case("a group failed for good at its first start (restartPolicy Never) is down",
         "ShoalEngineGroupDown", "2m",
         lambda w: w.operator([(0, status((FAILED, 0)))], until=300), [Expected(GROUP)]),
    # -- restarting in a loop
    Case("a third restart in a row is a loop", "ShoalEngineGroupRestartLoop", "3m30s",
         lambda w: w.operator([(0, status((READY, 0))), (60, status((BACKING_OFF, 1))),
                               (80, status((STARTING, 1))), (120, status((BACKING_OFF, 2))),
                               (140, status((STARTING, 2))), (200, status((BACKING_OFF, 3)))],
                              until=300), [Expected(GROUP, "3")]),
    Case("two restarts are not a loop", "ShoalEngineGroupRestartLoop", "3m",
         lambda w: w.operator([(0, status((READY, 0))), (60, status((BACKING_OFF, 1))),
                               (80, status((STARTING, 1))), (120, status((BACKING_OFF, 2))),
                               (140, status((STARTING, 2)))], until=300), []),
    # -- not Ready past the start-up bound (startupTimeoutSeconds 60 + 120 s = 180 s)
    Case("a group not Ready past its start-up bound", "ShoalEngineGroupNotReady", "4m",
         lambda w: w.operator([(0, status((STARTING, 0)))], until=300, startup_timeout=60),
         [Expected(GROUP, "4m 0s")]),
    Case("the operator's stall restart does not restart the clock", "ShoalEngineGroupNotReady",
         "4m", lambda w: w.operator([(0, status((STARTING, 0))),
                                     (180, status((BACKING_OFF, 1))),
                                     (195, status((STARTING, 1)))], until=300,
                                    startup_timeout=60),
         [Expected(GROUP, "4m 0s")]),
    Case("a group Ready within its bound", "ShoalEngineGroupNotReady", "4m",
         lambda w: w.operator([(0, status((STARTING, 0))), (150, status((READY, 0)))],
                              until=300, startup_timeout=60), []),
    Case("ten minutes of start-up are within the default bound (1200 s + 120 s)",
         "ShoalEngineGroupNotReady", "10m",
         lambda w: w.operator([(0, status((STARTING, 0)))], until=600), []),
    # -- KV cache near full for minutes (0.9 for 5m)
    Case("KV cache above 90% for 5 minutes", "ShoalKVCacheNearFull", "6m",
         lambda w: w.vllm("vllm:kv_cache_usage_perc", "0.95x10"), [Expected(GROUP, "95%")],
         interval="1m"),
    Case("KV cache at 85% is not near full", "ShoalKVCacheNearFull", "6m",
         lambda w: w.vllm("vllm:kv_cache_usage_perc", "0.85x10"), [], interval="1m"),
    Case("a 3-minute KV spike is not minutes", "ShoalKVCacheNearFull", "6m",
         lambda w: w.vllm("vllm:kv_cache_usage_perc", "0.95 0.95 0.95 0.5x7"), [],
         interval="1m"),
    # -- waiting requests growing (above 10 and growing, for 10m)
    Case("waiting requests growing past 10 for 10 minutes", "ShoalWaitingRequestsGrowing",
         "20m", lambda w: w.vllm("vllm:num_requests_waiting", "0+2x30"),
         [Expected(ENGINE, "40")], interval="1m"),
    Case("a long queue that does not grow", "ShoalWaitingRequestsGrowing", "20m",
         lambda w: w.vllm("vllm:num_requests_waiting", "50x30"), [], interval="1m"),
    Case("a growing queue below 10", "ShoalWaitingRequestsGrowing", "20m",
         lambda w: w.vllm("vllm:num_requests_waiting", "0+0.25x30"), [], interval="1m"),
    # -- TTFT p90 above the objective (2 s, 10m)
    Case("first tokens between 2.5 and 5 s for 15 minutes: p90 4.75 s",
         "ShoalTTFTAboveObjective", "15m",
         lambda w: w.vllm("vllm:time_to_first_token_seconds_bucket", "0x20",
                          lambda labels: float(labels["le"]) <= 2.5)
         + w.vllm("vllm:time_to_first_token_seconds_bucket", "0+10x20",
                  lambda labels: float(labels["le"]) > 2.5),
         [Expected(ENGINE, "4.75s")], interval="1m"),
    Case("first tokens between 0.25 and 0.5 s meet the objective", "ShoalTTFTAboveObjective", "15m",
         lambda w: w.vllm("vllm:time_to_first_token_seconds_bucket", "0x20",
                          lambda labels: float(labels["le"]) <= 0.25)
         + w.vllm("vllm:time_to_first_token_seconds_bucket", "0+10x20",
                  lambda labels: float(labels["le"]) > 0.25), [], interval="1m"),
    Case("no traffic: no TTFT alert", "ShoalTTFTAboveObjective", "15m",
         lambda w: w.vllm("vllm:time_to_first_token_seconds_bucket", "0x20"), [],
         interval="1m"),
    # -- a frontend with no ready group (1m)
    Case("a frontend with no usable group for a minute", "ShoalFrontendNoReadyGroup", "2m",
         lambda w: w.router("shoal_router_groups_usable", "0x20")
         + w.operator([(0, status((BACKING_OFF, 1)))], until=300),
         [Expected({**ENGINE, "pod": "llm-frontend-7d9f8-x2x4q"})]),
    Case("a frontend with no group is fine while the engine is scaled to zero",
         "ShoalFrontendNoReadyGroup", "2m",
         lambda w: w.router("shoal_router_groups_usable", "0x20")
         + w.operator([(0, status(replicas=0))], until=300), []),
    Case("a frontend with a usable group", "ShoalFrontendNoReadyGroup", "2m",
         lambda w: w.router("shoal_router_groups_usable", "1x20"), []),
    # -- the operator down (5m)
    Case("no operator scraped for 5 minutes", "ShoalOperatorDown", "8m",
         lambda w: w.operator([(0, status((READY, 0)))], until=120, stale_after=True),
         [Expected({})]),
    Case("an operator gone for less than 5 minutes", "ShoalOperatorDown", "6m",
         lambda w: w.operator([(0, status((READY, 0)))], until=120, stale_after=True), []),
    Case("a running operator", "ShoalOperatorDown", "8m",
         lambda w: w.operator([(0, status((READY, 0)))], until=600), []),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_alert(case, world, rules, promtool, tmp_path):
    proc = promtool_test(promtool, rules, tmp_path, alert=case.alert,
                         input_series=case.input(world), interval=case.interval, at=case.at,
                         expect=case.expect)
    assert proc.returncode == 0, (f"promtool test rules failed for {case.alert} at {case.at}:\n"
                                  f"{proc.stdout}{proc.stderr}\n"
                                  f"test file:\n{(tmp_path / 'test.yaml').read_text()}")


def test_every_alert_has_a_firing_and_a_silent_case(rules):
    import yaml

    alerts = {r["alert"] for g in yaml.safe_load(rules)["groups"] for r in g["rules"]}
    assert alerts == {c.alert for c in CASES if c.expect} == {c.alert for c in CASES
                                                              if not c.expect}


def _scraped_exports(world: World) -> dict[str, list[dict]]:
    """Every series the three components export, labelled as their scrape labels them (the
    operator with a group not Ready, so that every one of its series is there)."""
    import datetime as dt

    from shoal.operator.metrics import OperatorMetrics

    metrics = OperatorMetrics()
    metrics.report(*world.engine(), status((STARTING, 1)), dt.datetime.now(dt.timezone.utc))
    out: dict[str, list[dict]] = {}
    for job, pod, text in [("shoal-engines", world.rank0(), world.expositions["engine"]),
                           ("shoal-frontends", world.frontend_pod(),
                            world.expositions["frontend"]),
                           ("shoal-operator", world.operator_pod, metrics.render())]:
        for name, label_sets in exported(text).items():
            out.setdefault(name, []).extend(scraped(job, pod, ls) for ls in label_sets)
    return out


def test_every_series_the_rules_read_is_exported_with_the_labels_they_use(rules, world):
    import re

    import yaml

    exports = _scraped_exports(world)
    for rule in (r for g in yaml.safe_load(rules)["groups"] for r in g["rules"]):
        names = re.findall(r"\b(vllm:[a-z_:]+|shoal_[a-z_]+)\b", rule["expr"])
        assert names, rule["alert"]
        missing = [n for n in names if n not in exports]
        assert not missing, f"{rule['alert']} reads series nobody exports: {missing}"
        # `agg by (labels) (series...)`: every series has every label it is aggregated by.
        for by, name in re.findall(r"by \(([^)]*)\) \((?:\w+\()?([a-z_:]+)", rule["expr"]):
            wanted = {label.strip() for label in by.split(",")}
            for labels in exports[name]:
                assert wanted <= labels.keys(), (rule["alert"], name, wanted - labels.keys())
