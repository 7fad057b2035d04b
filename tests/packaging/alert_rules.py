"""What the alert tests share: the chart's rule file as helm renders it, `promtool test rules`
on it, and input series made the way Prometheus would make them: a component's real /metrics
(names, labels, histogram buckets) plus the target labels that the shipped scrape configuration
(examples/autoscaling/prometheus-scrape.yaml) gives the pod the operator renders.

The operator's series go further: a case gives a timeline of statuses, and the real
`shoal.operator.metrics` module turns each into the values of that instant (so its clocks and
dropped series are the module's own)."""

from __future__ import annotations

import datetime as dt
import re
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml
from packaging_support import EXAMPLES
from support.prometheus_tools import pod_targets

SCRAPE_CONFIG = EXAMPLES / "autoscaling" / "prometheus-scrape.yaml"
RULES_KEY = "shoal-alerts.rules.yaml"
EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)  # promtool's clock starts here


def rules_text(helm_template, *sets: str) -> str:
    """The rule file the chart ships (its ConfigMap's key), with these `--set` values."""
    args = ["--set", "monitoring.alerts.configMap.enabled=true"]
    for s in sets:
        args += ["--set", s]
    (cm,) = [o for o in helm_template(*args)
             if o["kind"] == "ConfigMap" and RULES_KEY in (o.get("data") or {})]
    return cm["data"][RULES_KEY]


def alert_rule(rules: str, name: str) -> dict:
    (rule,) = [r for g in yaml.safe_load(rules)["groups"] for r in g["rules"]
               if r.get("alert") == name]
    return rule


# ---- series as a scrape makes them ------------------------------------------------------------


def exported(text: str) -> dict[str, list[dict]]:
    """Sample name -> the label sets a /metrics text has for it."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[dict]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(dict(s.labels))
    return out


def scrape_job(job: str) -> dict:
    cfg = yaml.safe_load(SCRAPE_CONFIG.read_text())
    (found,) = [j for j in cfg["scrape_configs"] if j["job_name"] == job]
    return found


def target_labels(job: str, pod: dict, ip: str = "10.0.0.7") -> dict | None:
    """The labels the shipped job gives a target on `pod` (kubernetes_sd role: pod, as
    support.prometheus_tools.pod_targets writes it for the e2e Prometheus; keep and replace
    rules, Prometheus' defaults), or None when no port of the pod is kept."""
    cfg = scrape_job(job)
    for group in pod_targets([{**pod, "status": {"podIP": ip, "phase": "Running"}}]):
        (address,) = group["targets"]
        labels = {**group["labels"], "__address__": address}
        for rule in cfg["relabel_configs"]:
            value = (rule.get("separator", ";")).join(labels.get(s, "")
                                                       for s in rule["source_labels"])
            m = re.fullmatch(rule.get("regex", "(.*)"), value)
            if rule.get("action", "replace") == "keep":
                if not m:
                    break
            elif m:
                labels[rule["target_label"]] = m.expand(
                    rule.get("replacement", "$1").replace("$1", r"\1"))
        else:
            kept = {k: v for k, v in labels.items() if not k.startswith("__")}
            return {"job": job, "instance": labels["__address__"], **kept}
    return None


def scraped(job: str, pod: dict, metric_labels: Mapping) -> dict:
    """One series' labels after the scrape: the target's win unless the job honours the
    metric's own (honor_labels)."""
    target = target_labels(job, pod)
    assert target is not None, f"job {job} keeps no port of pod {pod['metadata']['name']}"
    if scrape_job(job).get("honor_labels"):
        return {**target, **metric_labels}
    return {**metric_labels, **target}


def series(name: str, labels: Mapping) -> str:
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


# ---- the operator's series over time ------------------------------------------------------------


def operator_series(statuses: Sequence[tuple[float, dict]], ref, spec, pod: dict,
                    step: float, until: float) -> list[dict]:
    """promtool input series of the operator from a timeline of statuses ((from_second,
    status), ...): each step, the real OperatorMetrics gets the status of that instant, and its
    /metrics text gives the values (a series that leaves the text is marked stale, as a scrape
    does, then has no sample: "_")."""
    from prometheus_client.parser import text_string_to_metric_families
    from shoal.operator.metrics import OperatorMetrics

    metrics = OperatorMetrics()
    values: dict[str, list[str]] = {}
    for i in range(int(until // step) + 1):
        t = i * step
        status = [s for since, s in statuses if since <= t][-1]
        metrics.report(ref, spec, status, EPOCH + dt.timedelta(seconds=t))
        for fam in text_string_to_metric_families(metrics.render()):
            for s in fam.samples:
                key = series(s.name, scraped("shoal-operator", pod, s.labels))
                values.setdefault(key, ["_"] * i).append(_num(s.value))
        for vals in values.values():  # gone from this scrape: a staleness marker, as a
            if len(vals) == i:        # scrape writes one, then nothing
                vals.append("stale" if vals[-1] not in ("_", "stale") else "_")
    return [{"series": k, "values": " ".join(v)} for k, v in values.items()]


def _num(v: float) -> str:
    return repr(float(v)) if v != int(v) else str(int(v))


# ---- promtool ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Expected:
    """A firing alert: its labels, and what `{{ $value ... }}` prints in its annotations."""

    labels: Mapping[str, str]
    value: str = ""


def annotations(rule: dict, labels: Mapping, value: str) -> dict:
    """The rule's annotations as Prometheus renders them for these labels and value text."""
    out = {}
    for k, text in (rule.get("annotations") or {}).items():
        text = re.sub(r"\{\{\s*\$labels\.(\w+)\s*\}\}", lambda m: labels[m.group(1)], text)
        out[k] = re.sub(r"\{\{\s*\$value[^}]*\}\}", value, text)
    return out


def promtool_test(promtool: Path, rules: str, tmp: Path, *, alert: str, input_series: list,
                  interval: str, at: str,
                  expect: Sequence[Expected]) -> subprocess.CompletedProcess:
    """`promtool test rules` of one alert at one time against the rule file."""
    rule = alert_rule(rules, alert)
    exp = [{"exp_labels": {**rule.get("labels", {}), **e.labels},
            "exp_annotations": annotations(rule, e.labels, e.value)} for e in expect]
    (tmp / "rules.yaml").write_text(rules)
    test = {"rule_files": ["rules.yaml"], "evaluation_interval": interval,
            "tests": [{"interval": interval, "input_series": input_series,
                       "alert_rule_test": [{"eval_time": at, "alertname": alert,
                                            "exp_alerts": exp}]}]}
    (tmp / "test.yaml").write_text(yaml.safe_dump(test, sort_keys=False))
    return subprocess.run([str(promtool), "test", "rules", "test.yaml"], cwd=tmp,
                          capture_output=True, text=True, timeout=60)
