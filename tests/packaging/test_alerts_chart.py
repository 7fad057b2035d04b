"""The chart's alerts as objects: off by default; one rule file rendered into a PrometheusRule
and a ConfigMap alike; accepted by `promtool check rules` at the defaults and at other values;
every threshold and duration a value that reaches its rule; the operator's metrics port and
the monitors that scrape what the rules read."""

from __future__ import annotations

import pytest
import yaml
from alert_rules import RULES_KEY, alert_rule, rules_text
from kube_schemas import problems
from packaging_support import HelmError, run
from support.prometheus_tools import PrometheusMissing, ensure_prometheus
from test_chart import the

pytestmark = pytest.mark.process  # real processes (helm, promtool)

ALERTS = ["ShoalEngineGroupDown", "ShoalEngineGroupRestartLoop", "ShoalEngineGroupNotReady",
          "ShoalKVCacheNearFull", "ShoalWaitingRequestsGrowing", "ShoalTTFTAboveObjective",
          "ShoalFrontendNoReadyGroup", "ShoalOperatorDown"]

# Values that differ from every default: (value key, --set value, alert, what its rule shows)
CUSTOM = [
    ("groupDownFor", "3m", "ShoalEngineGroupDown", ("for", "3m")),
    ("restartLoopRestarts", "5", "ShoalEngineGroupRestartLoop", ("expr", ">= 5\n")),
    ("kvCacheUsage", "0.8", "ShoalKVCacheNearFull", ("expr", "> 0.8\n")),
    ("kvCacheFor", "7m", "ShoalKVCacheNearFull", ("for", "7m")),
    ("waitingRequests", "25", "ShoalWaitingRequestsGrowing", ("expr", "> 25\n")),
    ("waitingFor", "15m", "ShoalWaitingRequestsGrowing", ("for", "15m")),
    ("ttftP90ObjectiveSeconds", "0.5", "ShoalTTFTAboveObjective", ("expr", "> 0.5\n")),
    ("ttftFor", "20m", "ShoalTTFTAboveObjective", ("for", "20m")),
    ("frontendNoGroupFor", "2m", "ShoalFrontendNoReadyGroup", ("for", "2m")),
    ("operatorDownFor", "10m", "ShoalOperatorDown", ("for", "10m")),
]


@pytest.fixture(scope="module")
def promtool():
    try:
        return ensure_prometheus().promtool
    except PrometheusMissing as e:
        pytest.fail(f"promtool is needed for the alert tests: {e}", pytrace=False)


def test_alerts_are_off_by_default(helm_template):
    objs = helm_template()
    assert not [o for o in objs if o["kind"] == "PrometheusRule"]
    assert not [o for o in objs if o["kind"] == "ConfigMap"]


def test_the_prometheus_rule_and_the_configmap_hold_the_same_rule_file(helm_template):
    objs = helm_template("--set", "monitoring.alerts.prometheusRule.enabled=true",
                         "--set", "monitoring.alerts.prometheusRule.labels.release=kps",
                         "--set", "monitoring.alerts.configMap.enabled=true")
    (rule,) = [o for o in objs if o["kind"] == "PrometheusRule"]
    (cm,) = [o for o in objs if o["kind"] == "ConfigMap"]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["labels"]["release"] == "kps"
    assert (rule["metadata"]["namespace"], cm["metadata"]["namespace"]) == ("shoal-system",) * 2
    assert rule["spec"] == yaml.safe_load(cm["data"][RULES_KEY])
    assert not problems(cm)
    names = [r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]]
    assert names == ALERTS


@pytest.mark.parametrize("sets", [(), tuple(f"monitoring.alerts.{k}={v}" for k, v, *_ in CUSTOM)],
                         ids=["defaults", "every value changed"])
def test_promtool_accepts_the_rule_file(helm_template, promtool, tmp_path, sets):
    path = tmp_path / "shoal.rules.yaml"
    path.write_text(rules_text(helm_template, *sets))
    proc = run([promtool, "check", "rules", path])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in proc.stdout, proc.stdout


@pytest.mark.parametrize("key, value, alert, shows", CUSTOM, ids=[c[0] for c in CUSTOM])
def test_each_threshold_is_a_value(helm_template, key, value, alert, shows):
    default = alert_rule(rules_text(helm_template), alert)
    rule = alert_rule(rules_text(helm_template, f"monitoring.alerts.{key}={value}"), alert)
    field, text = shows
    assert text in str(rule[field]) and text not in str(default[field]), (rule, default)


def test_bad_alert_values_are_refused(helm_template):
    with pytest.raises(HelmError, match="kvCacheUsage"):
        helm_template("--set", "monitoring.alerts.kvCacheUsage=90")
    with pytest.raises(HelmError, match="groupDownFor"):
        helm_template("--set", "monitoring.alerts.groupDownFor=1 minute")


def test_the_operator_serves_metrics_on_its_own_port(helm_template):
    from shoal.operator.__main__ import parse_args

    objs = helm_template("--set", "metricsPort=9100", "--set", "monitoring.podAnnotations=true")
    pod = the(objs, "Deployment")["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    assert {"name": "metrics", "containerPort": 9100, "protocol": "TCP"} in c["ports"]
    assert parse_args(c["args"]).metrics_port == 9100  # the operator's own parser
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "9100"
    with pytest.raises(HelmError, match="metricsPort=8080 is healthPort too"):
        helm_template("--set", "metricsPort=8080")


def test_monitors_scrape_what_the_rules_read(helm_template):
    objs = helm_template("--set", "monitoring.serviceMonitor.enabled=true")
    monitors = {o["metadata"]["name"]: o for o in objs if o["kind"] == "PodMonitor"}
    assert sorted(monitors) == ["shoal-engines", "shoal-frontends", "shoal-operator"]
    op_pod = the(objs, "Deployment")["spec"]["template"]
    (endpoint,) = monitors["shoal-operator"]["spec"]["podMetricsEndpoints"]
    assert endpoint["honorLabels"] is True  # the series' namespace is the engine's
    assert endpoint["port"] in [p["name"] for p in op_pod["spec"]["containers"][0]["ports"]]
    selector = monitors["shoal-operator"]["spec"]["selector"]["matchLabels"]
    assert selector.items() <= op_pod["metadata"]["labels"].items()
    (fe,) = monitors["shoal-frontends"]["spec"]["podMetricsEndpoints"]
    assert [r["targetLabel"] for r in fe["relabelings"]] == ["inference_engine"]
