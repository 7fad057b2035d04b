"""The API server stopped under a running operator (a control plane of this test's own, so the
suite's shared one stays up): the real operator process rides the outage out and acts on the
first change after it, without restarting. On real pods, with frontends serving through it:
tests/e2e/test_e2e_control_plane_faults.py."""

from __future__ import annotations

import pytest
from shoal.devcluster.control_plane import ControlPlane
from shoal.operator.kube import Kube
from support import crds, kubelet
from support.builders import engine
from support.engine_api import create_ie, ie
from support.operator_proc import OperatorProcess
from support.wait import wait_for

pytestmark = pytest.mark.k8s
DOWN_SECONDS = 45  # past the node monitor's 40 s grace, and past kopf's default retries


def _ready_groups(kube, ns: str) -> int:
    return ((ie(kube, ns, "out") or {}).get("status") or {}).get("readyReplicas", 0)


def test_the_operator_rides_out_an_api_server_outage_and_resyncs(control_plane, tmp_path):
    from kubernetes import client, config

    cp = ControlPlane(tmp_path / "cp").start()  # control_plane: the binaries are built
    op = let = None
    try:
        api = config.new_client_from_config(config_file=str(cp.kubeconfig))
        kube, core = Kube(api), client.CoreV1Api(api)
        crds.install(kube)
        ns = "opo-outage"
        core.create_namespace({"metadata": {"name": ns}})
        op = OperatorProcess(cp, "opo-*", tmp_path / "operator.log").start()
        create_ie(kube, engine("out", ns).manifest())
        let = kubelet.Kubelet(core, ns, "out")
        let.start()
        wait_for(lambda: _ready_groups(kube, ns) == 1, timeout=30, what="1 group Ready")

        took = cp.outage("kube-apiserver", DOWN_SECONDS)
        assert took["down_s"] >= DOWN_SECONDS
        assert op.proc.poll() is None, f"the operator exited during the outage:\n{op.tail()}"
        kube.patch("shoal.dev/v1alpha1", "inferenceengines", ns, "out", {"spec": {"replicas": 2}})
        wait_for(lambda: _ready_groups(kube, ns) == 2, timeout=60,
                 what="the change after the outage acted on", detail=op.tail)
        assert op.proc.poll() is None
        assert "escalating" not in op.log_path.read_text(), "a watch gave up"
        assert ((ie(kube, ns, "out") or {}).get("status") or {}).get("restartCount", 0) == 0
    finally:
        if let is not None:
            let.stop()
        if op is not None:
            op.stop()
        cp.stop()
