"""The test control plane does what the operator's tests rely on.

Each test checks one promise of the `control_plane` fixture: a real API server (version, schema
validation, custom resources), the StatefulSet controller, pod status written by the test acting
as kubelet, and the garbage collector, including for objects owned by a custom resource.
"""

from __future__ import annotations

import shutil
import subprocess
import uuid

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from support import kubelet
from support.wait import wait_for, wait_gone

pytestmark = pytest.mark.k8s

GROUP = "cptest.shoal.dev"


@pytest.fixture
def api(control_plane):
    with control_plane.api_client() as api:
        yield api


@pytest.fixture
def ns(control_plane):
    return control_plane.new_namespace("cp")


def _sts(name: str, replicas: int, policy: str = "Parallel") -> dict:
    labels = {"app": name}
    return {
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "serviceName": name,
            "podManagementPolicy": policy,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "containers": [
                        {"name": "engine", "image": "shoal/engine:test", "args": ["serve"]}
                    ]
                },
            },
        },
    }


def _pod_names(core: client.CoreV1Api, ns: str, app: str) -> list[str]:
    return sorted(
        p.metadata.name for p in core.list_namespaced_pod(ns, label_selector=f"app={app}").items
    )


def _sts_status(apps: client.AppsV1Api, ns: str, name: str) -> dict:
    sts = apps.read_namespaced_stateful_set(name, ns)
    return apps.api_client.sanitize_for_serialization(sts.status) or {}


@pytest.fixture(scope="module")
def widget_crd(control_plane):
    """A namespaced CRD with a structural schema, established before use, deleted after."""
    plural = f"widgets{uuid.uuid4().hex[:6]}"
    name = f"{plural}.{GROUP}"
    body = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": name},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "plural": plural,
                "singular": plural[:-1],
                "kind": "Widget" + plural[7:],
                "listKind": "Widget" + plural[7:] + "List",
            },
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": {
                                    "type": "object",
                                    "required": ["replicas"],
                                    "properties": {
                                        "replicas": {"type": "integer", "minimum": 0},
                                        "model": {"type": "string"},
                                    },
                                },
                                "status": {
                                    "type": "object",
                                    "x-kubernetes-preserve-unknown-fields": True,
                                },
                            },
                        }
                    },
                }
            ],
        },
    }
    with control_plane.api_client() as api:
        ext = client.ApiextensionsV1Api(api)
        ext.create_custom_resource_definition(body)

        def established() -> bool:
            crd = ext.read_custom_resource_definition(name)
            return any(
                c.type == "Established" and c.status == "True"
                for c in (crd.status.conditions or [])
            )

        wait_for(established, timeout=30, what=f"CRD {name} Established")
        yield {"plural": plural, "kind": body["spec"]["names"]["kind"]}
        ext.delete_custom_resource_definition(name)


def test_real_api_server_version(api):
    info = client.VersionApi(api).get_code()
    assert info.git_version == "v1.20.2"


def test_kubeconfig_works_with_kubectl(control_plane):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (the Python client tests cover the kubeconfig)")
    out = subprocess.run(
        [kubectl, "--kubeconfig", control_plane.kubeconfig, "get", "--raw", "/readyz"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_custom_resource_post_and_schema_validation(api, ns, widget_crd):
    """POSTing a custom resource once crashed this server (vendored reflect2 under go 1.19)."""
    co = client.CustomObjectsApi(api)
    plural, kind = widget_crd["plural"], widget_crd["kind"]
    created = co.create_namespaced_custom_object(
        GROUP,
        "v1",
        ns,
        plural,
        {
            "apiVersion": f"{GROUP}/v1",
            "kind": kind,
            "metadata": {"name": "w1"},
            "spec": {"replicas": 2, "model": "tiny"},
        },
    )
    assert created["spec"] == {"replicas": 2, "model": "tiny"}
    co.patch_namespaced_custom_object_status(
        GROUP, "v1", ns, plural, "w1", {"status": {"phase": "Ready"}}
    )
    got = co.get_namespaced_custom_object(GROUP, "v1", ns, plural, "w1")
    assert got["status"] == {"phase": "Ready"}

    with pytest.raises(ApiException) as err:
        co.create_namespaced_custom_object(
            GROUP,
            "v1",
            ns,
            plural,
            {
                "apiVersion": f"{GROUP}/v1",
                "kind": kind,
                "metadata": {"name": "bad"},
                "spec": {"replicas": -1},
            },
        )
    assert err.value.status == 422
    assert "spec.replicas" in err.value.body


def test_statefulset_controller_creates_pods_in_order(api, ns):
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    apps.create_namespaced_stateful_set(ns, _sts("ordered", 2, policy="OrderedReady"))
    wait_for(
        lambda: _pod_names(core, ns, "ordered") == ["ordered-0"], timeout=30, what="pod ordered-0"
    )
    # OrderedReady: ordered-1 waits for ordered-0 to be Running and Ready, which nobody but
    # the test (as kubelet) can make so. A controller sync creates all the pods it may and then
    # writes status, so once status counts one replica, a second pod would already exist.
    wait_for(
        lambda: _sts_status(apps, ns, "ordered").get("replicas", 0) >= 1,
        timeout=30,
        what="StatefulSet status.replicas >= 1",
    )
    assert _pod_names(core, ns, "ordered") == ["ordered-0"]
    assert _sts_status(apps, ns, "ordered")["replicas"] == 1
    kubelet.set_ready(core, "ordered-0", ns)
    wait_for(
        lambda: _pod_names(core, ns, "ordered") == ["ordered-0", "ordered-1"],
        timeout=30,
        what="pod ordered-1 after ordered-0 became Ready",
    )
    kubelet.set_ready(core, "ordered-1", ns)
    wait_for(
        lambda: _sts_status(apps, ns, "ordered").get("readyReplicas") == 2,
        timeout=30,
        what="StatefulSet readyReplicas == 2",
    )


def test_kubelet_patch_running_then_terminated(api, ns):
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    apps.create_namespaced_stateful_set(ns, _sts("crash", 1))
    wait_for(lambda: _pod_names(core, ns, "crash") == ["crash-0"], timeout=30, what="crash-0")

    pod = kubelet.set_running(core, "crash-0", ns, ready=True)
    assert pod.status.phase == "Running"
    assert {c.type: c.status for c in pod.status.conditions}["Ready"] == "True"
    assert pod.status.container_statuses[0].state.running is not None

    msg = '{"cause": "engine_core_died", "rank": 0}'
    pod = kubelet.set_terminated(
        core,
        "crash-0",
        ns,
        exit_code=137,
        signal=9,
        reason="OOMKilled",
        message=msg,
        restarted=True,
    )
    cs = core.read_namespaced_pod_status("crash-0", ns).status.container_statuses[0]
    term = cs.last_state.terminated
    assert (term.exit_code, term.signal, term.reason, term.message) == (137, 9, "OOMKilled", msg)
    assert cs.restart_count == 1
    assert cs.state.waiting.reason == "CrashLoopBackOff"
    assert {c.type: c.status for c in pod.status.conditions}["Ready"] == "False"


def test_kubelet_terminated_pod_with_restart_policy_never_fails(api, ns):
    core = client.CoreV1Api(api)
    core.create_namespaced_pod(
        ns,
        {
            "metadata": {"name": "once"},
            "spec": {
                "restartPolicy": "Never",
                "containers": [{"name": "main", "image": "shoal/engine:test"}],
            },
        },
    )
    kubelet.set_running(core, "once", ns)
    pod = kubelet.set_terminated(core, "once", ns, exit_code=2, message="bad flag --tp")
    assert pod.status.phase == "Failed"
    term = pod.status.container_statuses[0].state.terminated
    assert (term.exit_code, term.reason, term.message) == (2, "Error", "bad flag --tp")


def test_garbage_collector_deletes_children_of_statefulset(api, ns):
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    apps.create_namespaced_stateful_set(ns, _sts("gc", 2))
    wait_for(lambda: len(_pod_names(core, ns, "gc")) == 2, timeout=30, what="2 gc pods")
    apps.delete_namespaced_stateful_set("gc", ns, propagation_policy="Background")
    wait_for(
        lambda: _pod_names(core, ns, "gc") == [],
        timeout=60,
        what="GC to delete the StatefulSet's pods",
    )


def test_garbage_collector_deletes_children_of_custom_resource(api, ns, widget_crd):
    """The operator's case: a custom resource owns a StatefulSet (and through it, pods)."""
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    co = client.CustomObjectsApi(api)
    plural, kind = widget_crd["plural"], widget_crd["kind"]
    owner = co.create_namespaced_custom_object(
        GROUP,
        "v1",
        ns,
        plural,
        {
            "apiVersion": f"{GROUP}/v1",
            "kind": kind,
            "metadata": {"name": "owner"},
            "spec": {"replicas": 1},
        },
    )
    sts = _sts("owned", 1)
    sts["metadata"]["ownerReferences"] = [
        {
            "apiVersion": f"{GROUP}/v1",
            "kind": kind,
            "name": "owner",
            "uid": owner["metadata"]["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    apps.create_namespaced_stateful_set(ns, sts)
    wait_for(lambda: _pod_names(core, ns, "owned") == ["owned-0"], timeout=30, what="owned-0")

    co.delete_namespaced_custom_object(
        GROUP, "v1", ns, plural, "owner", propagation_policy="Background"
    )
    # The GC learns new resource types by re-reading discovery every 30 s, hence the margin.
    wait_gone(
        lambda: apps.read_namespaced_stateful_set("owned", ns),
        timeout=90,
        what="GC to delete the StatefulSet owned by a deleted custom resource",
    )
    wait_for(
        lambda: _pod_names(core, ns, "owned") == [],
        timeout=60,
        what="GC to delete the pods of that StatefulSet",
    )
