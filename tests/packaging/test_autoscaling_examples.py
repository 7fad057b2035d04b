"""The autoscaling examples (examples/autoscaling/) work with Shoal as it is: the HPA and the
KEDA ScaledObject target the InferenceEngine's scale subresource as crds/ defines it, every
metric they name is one a real `shoal serve` exports (scraped here), every label their queries
use is one the scrape configuration (plain Prometheus, or the chart's PodMonitor) sets, and that
configuration keeps exactly the pods the operator renders as rank 0."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
import yaml
from kube_schemas import problems
from packaging_support import EXAMPLES, REPO, load_all
from support.servers import ServeProcess

pytestmark = pytest.mark.process  # real processes and sockets (tests/conftest.py)

AUTOSCALING = EXAMPLES / "autoscaling"
METRIC = re.compile(r"\bvllm:[a-z_]+")


def _one(path: Path) -> dict:
    (obj,) = load_all(path)
    return obj


@pytest.fixture(scope="module")
def exported(tiny_model, tmp_path_factory) -> dict[str, set[str]]:
    """Every series a real `shoal serve` exports, with its label names, after one request."""
    from prometheus_client.parser import text_string_to_metric_families

    tmp = tmp_path_factory.mktemp("scrape")
    engine = ServeProcess(tiny_model, tmp, "--max-model-len", "512")
    try:
        engine.wait_healthy()
        r = httpx.post(f"{engine.url}/v1/completions", timeout=60,
                       json={"prompt": "hello", "max_tokens": 2})
        assert r.status_code == 200, r.text
        text = httpx.get(f"{engine.url}/metrics", timeout=10).text
    finally:
        engine.stop()
    out: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, set()).update(s.labels)
    return out


def _crd() -> dict:
    return yaml.safe_load((REPO / "crds" / "inferenceengines.shoal.dev.yaml").read_text())


def _scale_target_ok(ref: dict) -> None:
    crd = _crd()
    served = [v["name"] for v in crd["spec"]["versions"] if v["served"]]
    (version,) = [v for v in crd["spec"]["versions"]
                  if v["name"] == ref["apiVersion"].split("/")[1]]
    assert (ref["apiVersion"] == f"{crd['spec']['group']}/{version['name']}"
            and version["name"] in served)
    assert ref["kind"] == crd["spec"]["names"]["kind"]
    scale = version["subresources"]["scale"]
    assert scale["specReplicasPath"] == ".spec.replicas" and scale["labelSelectorPath"]
    # It names the example engine it is applied with.
    assert ref["name"] == _one(EXAMPLES / "cpu-single.yaml")["metadata"]["name"]


def test_hpa_scales_the_inference_engine_on_a_served_custom_metric(exported):
    hpa = _one(AUTOSCALING / "hpa.yaml")
    assert not problems(hpa)
    _scale_target_ok(hpa["spec"]["scaleTargetRef"])
    (metric,) = hpa["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    # prometheus-adapter serves it under that name, from a series the engine really exports.
    adapter = yaml.safe_load((AUTOSCALING / "prometheus-adapter-values.yaml").read_text())
    (rule,) = adapter["rules"]["custom"]
    assert rule["name"]["as"] == name
    (series,) = METRIC.findall(rule["seriesQuery"])
    assert re.fullmatch(rule["name"]["matches"], series)
    assert series == "vllm:num_requests_waiting" and series in exported
    # The labels it maps to Kubernetes objects are set by the scrape configuration.
    assert set(rule["resources"]["overrides"]) <= _scrape_target_labels()


def test_keda_scaledobject_targets_the_scale_subresource(exported):
    so = _one(AUTOSCALING / "keda-scaledobject.yaml")
    assert so["apiVersion"].startswith("keda.sh/") and so["kind"] == "ScaledObject"
    _scale_target_ok(so["spec"]["scaleTargetRef"])
    (trigger,) = so["spec"]["triggers"]
    query = trigger["metadata"]["query"]
    names = METRIC.findall(query)
    assert names == ["vllm:num_requests_waiting"] and all(n in exported for n in names)
    used = set(re.findall(r"([a-z_]+)=\"", query))
    assert used <= exported[names[0]] | _scrape_target_labels(), used


def _scrape_target_labels(job: str = "shoal-engines") -> set[str]:
    cfg = yaml.safe_load((AUTOSCALING / "prometheus-scrape.yaml").read_text())
    (engines,) = [j for j in cfg["scrape_configs"] if j["job_name"] == job]
    return {r["target_label"] for r in engines["relabel_configs"] if "target_label" in r}


def _meta(pod: dict) -> dict:
    """The pod's Kubernetes service-discovery labels, as Prometheus sees them."""
    def clean(k):
        return re.sub(r"[^a-zA-Z0-9_]", "_", k)
    (c,) = pod["spec"]["containers"]
    ports = [p["name"] for p in c.get("ports") or []]
    return {**{f"__meta_kubernetes_pod_label_{clean(k)}": v
               for k, v in pod["metadata"]["labels"].items()},
            "__meta_kubernetes_pod_container_port_name": ports}


def _kept(job: dict, meta: dict) -> bool:
    """Whether `job`'s keep rules keep some port of a pod with these meta labels."""
    for port in meta["__meta_kubernetes_pod_container_port_name"] or [""]:
        labels = {**meta, "__meta_kubernetes_pod_container_port_name": port}
        if all(re.fullmatch(r["regex"], ";".join(labels.get(s, "") for s in r["source_labels"]))
               for r in job["relabel_configs"] if r.get("action") == "keep"):
            return True
    return False


def test_scrape_configuration_keeps_exactly_the_rank0_pods_the_operator_renders(helm_template):
    from shoal.operator import render
    from shoal.operator.spec import parse

    body = {"apiVersion": "shoal.dev/v1alpha1", "kind": "InferenceEngine",
            "metadata": {"name": "llm", "namespace": "prod", "uid": "u"},
            "spec": {"model": "/m", "replicas": 2, "nodesPerGroup": 2, "tensorParallelSize": 2}}
    cfg = yaml.safe_load((AUTOSCALING / "prometheus-scrape.yaml").read_text())
    (job,) = [j for j in cfg["scrape_configs"] if j["job_name"] == "shoal-engines"]
    for group in (0, 1):
        rank0, rank1 = render.group_pods(*parse(body), group)
        assert _kept(job, _meta(rank0)) and not _kept(job, _meta(rank1))
    # The chart's PodMonitor selects the same pods, on the same port.
    objs = helm_template("--set", "monitoring.serviceMonitor.enabled=true")
    (pm,) = [o for o in objs if o["kind"] == "PodMonitor"
             and o["metadata"]["name"].endswith("-engines")]
    rank0 = render.engine_pod(*parse(body), 0, 0)
    labels = rank0["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in pm["spec"]["selector"]["matchLabels"].items())
    assert not all(render.engine_pod(*parse(body), 0, 1)["metadata"]["labels"].get(k) == v
                   for k, v in pm["spec"]["selector"]["matchLabels"].items())
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in [p["name"] for p in rank0["spec"]["containers"][0]["ports"]]
    # ...and sets the label the KEDA query selects on (namespace and pod it sets by itself).
    targets = {r["targetLabel"] for r in endpoint["relabelings"]} | {"namespace", "pod"}
    assert _scrape_target_labels() <= targets | {"engine_group"}
