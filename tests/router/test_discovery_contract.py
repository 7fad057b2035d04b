"""The operator's discovery data, as `render` produces it, is what the frontend's parser reads:
one part's real output fed into the other (no hand-typed copy of the format)."""

from __future__ import annotations

import pytest
from shoal.contract import discovery
from shoal.operator import labels as L
from shoal.operator import render
from shoal.operator.spec import EngineRef, parse
from shoal.router.discovery import DiscoveryWatcher, Group, parse_discovery


def _body(name: str = "llm", ns: str = "prod", replicas: int = 3) -> dict:
    return {"apiVersion": L.API_VERSION, "kind": L.KIND,
            "metadata": {"name": name, "namespace": ns, "uid": "u-1"},
            "spec": {"model": "/models/m", "servedModelName": "tiny", "replicas": replicas}}


@pytest.mark.parametrize("ready", [[], [0], [0, 2], [2, 1, 0]])
def test_rendered_configmap_parses_into_the_ready_groups(ready):
    cm = render.discovery_configmap(*parse(_body()), ready)
    found = parse_discovery(cm["data"][discovery.KEY])
    assert found.model == "tiny"
    assert found.groups == tuple(
        Group(g, f"http://llm-g{g}-r0.llm-ranks.prod.svc:{L.HTTP_PORT}") for g in sorted(ready))


def test_the_frontend_mounts_and_watches_what_the_operator_writes(tmp_path):
    """The frontend Deployment's discovery path/env point at the ConfigMap the operator writes;
    the watcher reads the rendered data from that path."""
    body = _body()
    dep = render.frontend_deployment(*parse(body))
    pod = dep["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    path = container["args"][container["args"].index("--engine-discovery-file") + 1]
    (mount,) = container["volumeMounts"]
    (vol,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    cm = render.discovery_configmap(*parse(body), [1])
    assert vol["configMap"]["name"] == cm["metadata"]["name"]
    assert path == f"{mount['mountPath']}/{discovery.KEY}"
    env = {e["name"]: e for e in container["env"]}
    assert env["SHOAL_DISCOVERY_CONFIGMAP"]["value"] == cm["metadata"]["name"]
    binding = render.frontend_role_binding(EngineRef.of(body))
    assert pod["serviceAccountName"] == binding["subjects"][0]["name"]
    (rule,) = render.frontend_role(*parse(body))["rules"]
    assert rule["resourceNames"] == [cm["metadata"]["name"]] and "watch" in rule["verbs"]

    local = tmp_path / discovery.KEY
    local.write_text(cm["data"][discovery.KEY])
    seen = []
    DiscoveryWatcher(str(local), seen.append).check()
    assert [d.groups for d in seen] == [(Group(1, "http://llm-g1-r0.llm-ranks.prod.svc:8000"),)]


def test_the_gateway_selects_and_reads_the_configmaps_the_operator_renders():
    """The gateway lists ConfigMaps by a label selector and names the engine by a label: both
    must be what `render` puts on the discovery ConfigMap, and its data must feed the fleet."""
    from pathlib import Path

    from shoal.router.discovery import Discovery
    from shoal.router.fleet import Fleet
    from shoal.router.fleet_sources import LABEL_ENGINE, SELECTOR, ConfigMapsSource

    cm = render.discovery_configmap(*parse(_body("llm", "prod")), [0, 2])
    labels = cm["metadata"]["labels"]
    wanted = dict(term.split("=", 1) for term in SELECTOR.split(","))
    assert wanted.items() <= labels.items() and LABEL_ENGINE == L.LABEL_ENGINE
    seen = []
    fleet = Fleet(seen.append)
    source = ConfigMapsSource("https://api", ["prod"], fleet, token_file=Path("t"),
                              ca_file=Path("c"))
    assert source.feed(cm) == "prod/llm"
    assert fleet.engines["prod/llm"] == Discovery(
        (Group(0, "http://llm-g0-r0.llm-ranks.prod.svc:8000", "prod/llm"),
         Group(2, "http://llm-g2-r0.llm-ranks.prod.svc:8000", "prod/llm")), "tiny")
    assert fleet.models() == {"tiny": ["prod/llm"]}
    # The discovery ConfigMap is the only ConfigMap the operator makes for an engine.
    children = render.render_children(*parse(_body("llm", "prod")))
    cms = [o for o in children if o["kind"] == "ConfigMap"]
    assert [c["metadata"]["name"] for c in cms] == [discovery.configmap_name("llm")]


def test_an_engine_that_scales_to_zero_is_wakeable_by_what_its_frontends_may_do(monkeypatch):
    """minReplicas 0: discovery says `wakeable` (so the routers hold), the operator renders the
    Lease the router's waker patches, the frontends' Role may patch exactly that Lease, and the
    Deployment sets what k8s_wake.from_environment reads. Without autoscaling: none of it."""
    from shoal.router import k8s_wake

    body = _body("chat", "team")
    body["spec"]["autoscaling"] = {"minReplicas": 0, "maxReplicas": 2, "requestsPerGroup": 4}
    ref, spec = parse(body)
    found = parse_discovery(render.discovery_configmap(ref, spec, [])["data"][discovery.KEY])
    assert found.wakeable and found.groups == ()
    children = render.render_children(ref, spec)
    (lease,) = [o for o in children if o["kind"] == "Lease"]
    assert lease["metadata"]["name"] == discovery.wake_lease_name("chat") == "chat-wake"
    assert lease["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    kinds = [o["kind"] for o in children]
    assert kinds.index("Lease") < kinds.index("Deployment"), "there before a frontend wakes it"
    rules = render.frontend_role(ref, spec)["rules"]
    (wake,) = [r for r in rules if "coordination.k8s.io" in r["apiGroups"]]
    assert wake["resources"] == ["leases"] and wake["resourceNames"] == ["chat-wake"]
    assert set(wake["verbs"]) == {"get", "patch"}
    # The frontend's environment, as the Deployment sets it, gives the waker its identity.
    (container,) = render.frontend_deployment(ref, spec)["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]
           if "valueFrom" in e}
    assert env[k8s_wake.POD_ENV] == "metadata.name"
    assert env[discovery.NAMESPACE_ENV] == "metadata.namespace"
    monkeypatch.setenv(k8s_wake.POD_ENV, "chat-frontend-x")
    monkeypatch.setenv(discovery.NAMESPACE_ENV, "team")
    monkeypatch.setattr(k8s_wake, "in_cluster_server", lambda: "https://10.0.0.1:443")
    waker = k8s_wake.from_environment()
    assert (waker.namespace, waker.holder) == ("team", "chat-frontend-x")

    still = _body("chat", "team")
    still["spec"]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 2, "requestsPerGroup": 4}
    for b in (still, _body("chat", "team")):
        ref, spec = parse(b)
        assert not parse_discovery(
            render.discovery_configmap(ref, spec, [])["data"][discovery.KEY]).wakeable
        assert "Lease" not in [o["kind"] for o in render.render_children(ref, spec)]
        assert len(render.frontend_role(ref, spec)["rules"]) == 1
