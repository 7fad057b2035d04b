"""The gateway on the real control plane: a real operator (`python -m shoal.operator`) renders
and writes each InferenceEngine's discovery ConfigMap; the gateway follows them through the API
with its own credentials. The test plays the kubelet (engine pods reported Ready), so the
groups' addresses are cluster names no one answers at: this test is about discovery;
tests/router/test_gateway_fleet.py sends traffic."""

from __future__ import annotations

import httpx
import pytest
from kubernetes import client
from router_helpers import GatewayProcess
from shoal.operator import labels as L
from shoal.operator.kube import Kube
from support import crds, kubelet
from support.builders import engine
from support.engine_api import cleanup_namespace, create_ie, pods
from support.operator_proc import OperatorProcess
from support.wait import wait_for

pytestmark = pytest.mark.k8s


@pytest.fixture
def setup(control_plane, tmp_path):
    kube = Kube(control_plane.api_client())
    crds.install(kube)
    # The namespace first: the operator then finds it in its first listing.
    ns = control_plane.new_namespace("gwk")
    op = OperatorProcess(control_plane, "gwk-*", tmp_path / "operator.log").start()
    try:
        yield kube, ns, op
    finally:
        cleanup_namespace(kube, ns)
        op.stop()


def _models(gw) -> list[str]:
    r = httpx.get(f"{gw.url}/v1/models", headers=gw.headers, timeout=5)
    return [m["id"] for m in r.json()["data"]]


def test_two_inference_engines_appear_in_the_gateways_models(control_plane, setup, tmp_path):
    kube, ns, op = setup
    token = tmp_path / "token"
    token.write_text(control_plane.token)
    gw = GatewayProcess(tmp_path, "--namespace", ns, "--kube-server", control_plane.server,
                        "--kube-token-file", str(token), "--kube-ca-file",
                        control_plane.ca_file)
    try:
        gw.wait_answering("/health", "the gateway to list its namespace", 30)
        for name, model in (("alpha", "alpha-model"), ("beta", "beta-model")):
            create_ie(kube, engine(name, ns).groups(2).set(servedModelName=model).manifest())
        wait_for(lambda: len(pods(kube, ns, "alpha")) == 2 and len(pods(kube, ns, "beta")) == 2,
                 30, what="the operator to create the engine pods", detail=op.tail)
        assert _models(gw) == []  # no group is Ready yet: nothing is served
        for name in ("alpha", "beta"):
            for pod in pods(kube, ns, name):
                kubelet.set_ready(client.CoreV1Api(kube.api), pod, ns)
        wait_for(lambda: _models(gw) == ["alpha-model", "beta-model"], 30,
                 what="both models in the gateway's /v1/models",
                 detail=lambda: f"{_models(gw)}\n{gw.log()[-1500:]}\n{op.tail(20)}")
        # Both models are listed once each engine has one ready group; the second may come a
        # discovery update later (it did, under load).
        wait_for(lambda: f"engine {ns}/alpha: model alpha-model, 2 ready group(s)" in gw.log(),
                 30, what="alpha's two ready groups in the gateway's log",
                 detail=lambda: gw.log()[-1500:])
        r = httpx.post(f"{gw.url}/v1/completions", headers=gw.headers, timeout=30,
                       json={"model": "gamma", "prompt": "hi"})
        assert r.status_code == 404 and "alpha-model, beta-model" in r.text

        kube.delete(L.API_VERSION, L.PLURAL, ns, "beta")
        wait_for(lambda: _models(gw) == ["alpha-model"], 60,
                 what="beta to leave the gateway once it is deleted",
                 detail=lambda: f"{_models(gw)}\n{gw.log()[-1500:]}")
        assert "following the discovery ConfigMaps in namespace" in gw.log()
    finally:
        rc = gw.stop()
    assert rc == 0, gw.log_path.read_text()[-2000:]
