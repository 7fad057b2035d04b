"""hf:// and oci:// models on real pods.

hf://: the model is served by the stand-in hub (tests/support/stand_in_hub.py: a stand-in,
because no real hub is reachable here; the `huggingface_hub` client in `shoal fetch` and its
cache are real) running as a pod of the router image behind a Service, its script from a
ConfigMap and its repositories the nodes' model hostPath (repo `shoal/shoal-tiny`). Two groups
of two ranks share one hostPath cache (the two local nodes share the host's filesystem): every
file is downloaded once. A wrong token fails the resource for good naming the repository; a
missing token Secret is a waiting reason naming it.

oci://: the project's model built into a model image (shoal.devcluster.images, KServe
modelcar layout) and loaded into the nodes; the 1.20 API server has no image volumes, so an init
container copies it into the pod.
"""

from __future__ import annotations

import shutil
import time
import uuid

import pytest
from shoal.devcluster.images import ensure_model_image
from shoal.devcluster.layout import MODEL_HOST_DIR, VAR_DIR
from support import hub_pod
from support.wait import wait_for

from e2e.e2e_helpers import create, record, service_url, status, wait_ready, wait_serving

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

TOKEN = hub_pod.TOKEN
REPO = f"{hub_pod.ORG}/shoal-tiny"  # the hub's root is the hostPath's parent
SMALL = {"max_model_len": 256}


@pytest.fixture(scope="module")
def hub(cluster):
    """The stand-in hub's in-cluster endpoint and its /_stats URL from the host."""
    ns = cluster.new_namespace("e2e-hub")
    yield hub_pod.start(cluster, ns)
    cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def _token_secret(cluster, ns: str, token: str) -> None:
    cluster.kubectl("create", "secret", "generic", "hf-token", "-n", ns,
                    f"--from-literal=HF_TOKEN={token}")


def _hf(hub: dict, secret: str = "hf-token", **spec) -> dict:
    return {"model": f"hf://{REPO}@main", "hfEndpoint": hub["endpoint"],
            "modelAuth": {"secretName": secret}, **SMALL, **spec}


@pytest.fixture
def shared_cache():
    path = VAR_DIR / f"e2e-model-cache-{uuid.uuid4().hex[:6]}"
    path.mkdir(parents=True)
    path.chmod(0o777)  # the fetcher runs as uid 10001
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_hf_two_groups_of_two_ranks_download_each_file_once(cluster, new_ns, hub,
                                                            shared_cache):
    ns = new_ns("e2e-hf")
    _token_secret(cluster, ns, TOKEN)
    before = hub_pod.stats(hub)["downloads"]
    t0 = time.monotonic()
    create(cluster, ns, "hf", replicas=2, nodes_per_group=2, tensor_parallel=2,
           extra_args=["--dtype", "float32"],
           **_hf(hub, modelCache={"hostPath": {"path": str(shared_cache)}}))
    wait_ready(cluster, ns, "hf", "2/2", timeout=480)
    ready_s = time.monotonic() - t0
    wait_serving(service_url(cluster, ns, "hf"))
    downloads = hub_pod.downloads_since(hub, before, REPO)
    record("model_source_hf_cold_ready", ready_s, groups=2, ranks=2,
           files=len(downloads), downloads=sum(downloads.values()))
    assert downloads and set(downloads.values()) == {1}, downloads
    assert any(k.endswith(".safetensors") for k in downloads), downloads
    assert (shared_cache / "hub" / "models--shoal--shoal-tiny").is_dir()


def test_hf_wrong_token_is_permanent_and_names_the_repository(cluster, new_ns, hub):
    ns = new_ns("e2e-hf-denied")
    _token_secret(cluster, ns, "hf_wrong")
    create(cluster, ns, "denied", **_hf(hub))

    def failed():
        st = status(cluster, ns, "denied")
        return st if st.get("phase") == "Failed" and st.get("lastFailure") else None

    st = wait_for(failed, timeout=240, interval=1, what="phase Failed with lastFailure")
    lf = st["lastFailure"]
    assert (lf["cause"], lf["permanent"]) == ("model_access_denied", True), lf
    assert REPO in lf["message"] and lf["reason"].startswith("model-fetch"), lf
    dead = {c["type"]: c for c in st["conditions"]}["EngineDead"]
    assert dead["reason"] == "PermanentError" and REPO in dead["message"], dead


def test_hf_missing_token_secret_is_a_waiting_reason_naming_it(cluster, new_ns, hub):
    ns = new_ns("e2e-hf-nosecret")
    create(cluster, ns, "nosecret", **_hf(hub, secret="no-such-secret"))

    def waiting():
        groups = status(cluster, ns, "nosecret").get("groups") or []
        msg = groups[0].get("message", "") if groups else ""
        return msg if 'secret "no-such-secret" not found' in msg else None

    msg = wait_for(waiting, timeout=120, interval=1, what="a waiting reason naming the Secret")
    assert "CreateContainerConfigError" in msg and "spec.modelAuth.secretName" in msg, msg


def test_oci_model_image_serves(cluster, new_ns):
    tag = "localhost/shoal/model-shoal-tiny:e2e"
    ensure_model_image(MODEL_HOST_DIR / "shoal-tiny", tag)
    ns = new_ns("e2e-oci")
    t0 = time.monotonic()
    create(cluster, ns, "oci", model=f"oci://{tag}", **SMALL)
    wait_ready(cluster, ns, "oci", "1/1")
    record("model_source_oci_ready", time.monotonic() - t0)
    wait_serving(service_url(cluster, ns, "oci"))
