"""The chart's alerts against the real cluster: a real Prometheus on this machine scrapes the
operator, the frontends and the engines by pod IP with the shipped scrape jobs of
examples/autoscaling/prometheus-scrape.yaml, and evaluates the rule file the chart renders at its
default thresholds and `for:` durations. Only the scrape and evaluation intervals are the
test's (2 s), and the discovery: Debian's prometheus has no kubernetes_sd, so the jobs'
`kubernetes_sd_configs` (role: pod) become a `file_sd_configs` file that PodDiscovery
(tests/support/prometheus_tools.py) fills from the cluster's API with the same labels; the
jobs' relabel rules are the shipped ones.

The engine's restart back-off (restartPolicy.backoffBaseSeconds, the user's own knob for how
long a dead group waits) is 90 s, so the group stays down longer than ShoalEngineGroupDown's
`for: 1m`: the alert must fire after the kill, before the restart, and resolve once the group
is Ready again."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml
from support.prometheus_tools import (
    PodDiscovery,
    PrometheusMissing,
    PrometheusServer,
    ensure_prometheus,
)
from support.wait import wait_for

from e2e.e2e_helpers import create, iso_seconds, kill9_engine_core, record, status, wait_ready

REPO = Path(__file__).resolve().parents[2]
SCRAPE = REPO / "examples" / "autoscaling" / "prometheus-scrape.yaml"
RULES_KEY = "shoal-alerts.rules.yaml"
BACKOFF_S = 90
INTERVAL, EVAL_S = "2s", 2
DOWN = "ShoalEngineGroupDown"
NO_GROUP = "ShoalFrontendNoReadyGroup"


def shipped_rules(cluster) -> str:
    """The rule file of the chart, default values (`helm template`, its ConfigMap)."""
    out = cluster.helm("template", "shoal", str(REPO / "charts" / "shoal"), "--namespace",
                       "shoal-system", "--set", "monitoring.alerts.configMap.enabled=true",
                       "--show-only", "templates/alerts.yaml")
    (cm,) = [d for d in yaml.safe_load_all(out) if d]
    return cm["data"][RULES_KEY]


def prometheus_config(targets: Path) -> dict:
    """The shipped scrape jobs, their pod discovery read from `targets` (PodDiscovery)."""
    jobs = yaml.safe_load(SCRAPE.read_text())["scrape_configs"]
    for job in jobs:
        assert [sd["role"] for sd in job.pop("kubernetes_sd_configs")] == ["pod"], job
        job["file_sd_configs"] = [{"files": [str(targets)], "refresh_interval": "1s"}]
    return {"global": {"scrape_interval": INTERVAL, "scrape_timeout": INTERVAL,
                       "evaluation_interval": INTERVAL},
            "scrape_configs": jobs}


def pod_lister(cluster, namespaces: list[str]):
    from kubernetes import client

    api = cluster.api_client()
    core = client.CoreV1Api(api)

    def pods() -> list[dict]:
        return [api.sanitize_for_serialization(p) for ns in namespaces
                for p in core.list_namespaced_pod(ns, _request_timeout=10).items]
    return pods


def firing_span(prom: PrometheusServer, ns: str, alert: str) -> tuple[float, float]:
    """The times of the first and the last evaluation that found `alert` firing in `ns`."""
    (series,) = prom.query(f'ALERTS{{alertname="{alert}",namespace="{ns}",'
                           f'alertstate="firing"}}[15m]')
    stamps = [float(t) for t, _ in series["values"]]
    return stamps[0], stamps[-1]


def alerts(prom: PrometheusServer, ns: str, name: str = DOWN, state: str | None = None):
    return [a for a in prom.alerts()
            if a["labels"].get("alertname") == name and a["labels"].get("namespace") == ns
            and state in (None, a["state"])]


@pytest.fixture
def prometheus(cluster, new_ns, tmp_path):
    try:
        ensure_prometheus()
    except PrometheusMissing as e:
        pytest.fail(f"prometheus is needed for the alert test: {e}", pytrace=False)
    ns = new_ns("e2e-alerts")
    sd = PodDiscovery(pod_lister(cluster, [ns, "shoal-system"]), tmp_path / "pods.json")
    prom = PrometheusServer(prometheus_config(tmp_path / "pods.json"),
                            {"shoal-alerts.rules.yaml": shipped_rules(cluster)}, tmp_path)
    try:
        yield ns, prom.wait_ready(), sd
    except BaseException:
        print(f"--- prometheus log:\n{prom.log(80)}")
        raise
    finally:
        prom.stop()
        sd.stop()


@pytest.mark.timeout(900)
def test_engine_down_alert_fires_after_a_kill_and_resolves_after_the_restart(cluster,
                                                                             prometheus):
    ns, prom, sd = prometheus
    name = "alerting"
    create(cluster, ns, name, restartPolicy={"backoffBaseSeconds": BACKOFF_S,
                                             "backoffMaxSeconds": 300})
    wait_ready(cluster, ns, name, "1/1")
    # Prometheus sees the group Ready through the operator's series (the operator's target is
    # up), and nothing about this engine is pending or firing.
    def seen_ready() -> bool:  # (ShoalOperatorDown is pending until the first scrape)
        return bool(prom.query(f'shoal_engine_group_ready{{namespace="{ns}"}} == 1')) and not [
            a for a in prom.alerts() if a["labels"]["alertname"] == "ShoalOperatorDown"]

    wait_for(seen_ready, timeout=60, interval=1,
             what="Prometheus to scrape the operator's Ready group",
             detail=lambda: f"pod discovery error: {sd.error}\n"
                            + json.dumps(prom.targets(), indent=1)[-4000:])
    # The frontend counted no ready group until its own probe saw the new one, so its alert can
    # be pending for a moment (seen on a run where the group was Ready within 14 s): it must
    # clear, and neither alert may fire.
    wait_for(lambda: not alerts(prom, ns) and not alerts(prom, ns, NO_GROUP), timeout=30,
             interval=1, what="no alert pending or firing for the Ready engine",
             detail=lambda: f"alerts: {prom.alerts()}")

    t_kill = time.time()  # before the kill: the alert can only come later
    kill9_engine_core(cluster, ns, f"{name}-g0-r0")
    fired = wait_for(lambda: alerts(prom, ns, state="firing"), timeout=BACKOFF_S + 60, interval=1,
                     what=f"{DOWN} to fire after the kill",
                     detail=lambda: f"alerts: {prom.alerts()}\nstatus: {status(cluster, ns, name)}")
    (alert,) = fired
    assert alert["labels"] == {"alertname": DOWN, "namespace": ns, "inference_engine": name,
                               "engine_group": "0", "severity": "warning"}
    assert alert["annotations"]["summary"] == f"Engine group 0 of {ns}/{name} is down"
    st = status(cluster, ns, name)
    assert st["groups"][0]["phase"] == "BackingOff" and st["restartCount"] == 1, st
    # The frontend, its only group gone from its discovery list, has fired too (its series
    # come through the shipped frontend job).
    (no_group,) = wait_for(lambda: alerts(prom, ns, NO_GROUP, "firing"), timeout=BACKOFF_S,
                           interval=1, what=f"{NO_GROUP} to fire during the back-off")
    assert no_group["labels"]["inference_engine"] == name
    assert no_group["labels"]["pod"].startswith(f"{name}-frontend-")

    st = wait_ready(cluster, ns, name, "1/1", timeout=BACKOFF_S + 240)
    assert st["restartCount"] == 1
    ready_since = iso_seconds(st["groups"][0]["readySince"])  # the API's 1 s resolution
    for name_, bound in ((DOWN, 10), (NO_GROUP, 15)):
        wait_for(lambda a=name_: not alerts(prom, ns, a), timeout=60, interval=1,
                 what=f"{name_} to resolve after the group is Ready again",
                 detail=lambda: f"alerts: {prom.alerts()}")
        # When, by Prometheus' own ALERTS series: the first and the last evaluation it fired.
        first, last = firing_span(prom, ns, name_)
        record("alert fired after kill", first - t_kill, alert=name_, backoff_s=BACKOFF_S)
        record("alert resolved after Ready", last + EVAL_S - ready_since, alert=name_)
        # Only once its `for: 1m` had passed, before the restart was due; firing until the
        # group was Ready again, and not much longer.
        assert 60 <= first - t_kill < BACKOFF_S, (name_, first - t_kill)
        assert ready_since - 4 <= last <= ready_since + bound, (name_, last - ready_since)
