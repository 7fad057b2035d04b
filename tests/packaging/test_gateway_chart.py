"""The chart's fleet gateway: on by default, Service `shoal-gateway` on port 8000 in the release
namespace, read-only access to ConfigMaps in exactly the namespaces it serves, a locked-down
pod, and a command line the gateway's own parser accepts; monitoring objects only when asked."""

from __future__ import annotations

import pytest
from kube_schemas import problems
from test_chart import by_kind, the

pytestmark = pytest.mark.process  # real processes and sockets (tests/conftest.py)


def _gateway_args(objs: list[dict]) -> list[str]:
    (c,) = the(objs, "Deployment", "gateway")["spec"]["template"]["spec"]["containers"]
    return c["args"]


def test_gateway_is_on_by_default_in_the_release_namespace(helm_template):
    objs = helm_template()
    svc = the(objs, "Service", "gateway")
    assert svc["metadata"]["name"] == "shoal-gateway"
    assert svc["metadata"]["namespace"] == "shoal-system"
    assert [(p["port"], p["targetPort"]) for p in svc["spec"]["ports"]] == [(8000, "http")]
    dep = the(objs, "Deployment", "gateway")
    pod = dep["spec"]["template"]["spec"]
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"] == \
        dep["spec"]["template"]["metadata"]["labels"]
    (c,) = pod["containers"]
    assert c["image"] == "ghcr.io/shoal-dev/shoal-router:0.1.0"
    assert "command" not in c  # the image entrypoint, `tini -g -- shoal`, stays PID 1
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert "--namespace=shoal-system" in c["args"]
    # Locked down like the operator: non-root, read-only root, nothing to escalate.
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
    errors = [line for o in by_kind(objs, "Deployment", "gateway") + [svc] for line in problems(o)]
    assert not errors, "\n".join(errors)


def test_gateway_may_only_read_configmaps_and_patch_leases_where_it_serves(helm_template):
    objs = helm_template("--set", "gateway.namespaces={team-a,team-b}")
    sa = the(objs, "ServiceAccount", "gateway")
    roles = by_kind(objs, "Role", "gateway")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    for role in roles:
        assert role["rules"] == [{"apiGroups": [""], "resources": ["configmaps"],
                                  "verbs": ["get", "list", "watch"]},
                                 {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                                  "verbs": ["patch"]}]  # the wake Leases (scale from zero)
    for b in by_kind(objs, "RoleBinding", "gateway"):
        assert b["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"],
                                  "namespace": "shoal-system"}]
    assert not by_kind(objs, "ClusterRole", "gateway")
    dep = the(objs, "Deployment", "gateway")
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]
    args = _gateway_args(objs)
    assert [a for a in args if a.startswith("--namespace=")] == ["--namespace=team-a",
                                                                  "--namespace=team-b"]


def test_the_charts_command_line_is_the_gateways(helm_template):
    """The rendered args, parsed by the gateway's own argument parser."""
    from shoal.router.gateway import build_parser

    objs = helm_template("--set", "gateway.routing=prefix-affinity",
                         "--set", "gateway.prefixImbalance=6", "--set", "logLevel=warning")
    (c,) = the(objs, "Deployment", "gateway")["spec"]["template"]["spec"]["containers"]
    assert "command" not in c and c["args"][0] == "gateway"  # the image's `tini -g -- shoal`
    args = build_parser().parse_args(c["args"][1:])
    assert (args.routing, args.prefix_imbalance, args.port) == ("prefix-affinity", 6, 8000)
    assert args.namespaces == ["shoal-system"] and args.log_level == "WARNING"


def test_gateway_can_be_turned_off_and_bad_values_are_refused(helm_template):
    from packaging_support import HelmError

    objs = helm_template("--set", "gateway.enabled=false")
    assert not [o for o in objs if (o["metadata"].get("labels") or {}).get(
        "app.kubernetes.io/component") == "gateway"]
    with pytest.raises(HelmError, match="prefix-affinity"):
        helm_template("--set", "gateway.routing=random")
    with pytest.raises(HelmError, match='"Team_A" is not a namespace name'):
        helm_template("--set", "gateway.namespaces={Team_A}")


def test_monitoring_is_off_by_default(helm_template):
    kinds = {o["kind"] for o in helm_template()}
    assert not kinds & {"PodMonitor", "ServiceMonitor"}
    objs = helm_template("--set", "monitoring.serviceMonitor.enabled=true",
                         "--set", "monitoring.podAnnotations=true")
    sm = [o for o in objs if o["kind"] == "ServiceMonitor"]
    (sm,) = sm
    svc = the(objs, "Service", "gateway")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"]
    annotations = the(objs, "Deployment", "gateway")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
