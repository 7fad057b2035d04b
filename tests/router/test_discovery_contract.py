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
    (rule,) = render.frontend_role(EngineRef.of(body))["rules"]
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
