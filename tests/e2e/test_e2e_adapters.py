"""InferenceAdapters on real pods: adapters made with the real `peft` on the project's model,
on the nodes' model hostPath, applied to a running two-group engine. Each is loaded on every
group through vLLM's endpoint, reported Ready only after a request through the Service, served
through the Service, loaded again on a restarted group before that group is Ready, refused for
good with the engine's reason (rank above spec.lora.maxLoraRank), retried while a file is not
readable by the engine's uid, and unloaded on delete."""

from __future__ import annotations

import shutil
import time
import urllib.request
import uuid

import pytest
from shoal.devcluster.layout import MODEL_HOST_DIR
from support.cluster import MODEL_MOUNT
from support.wait import wait_for

from e2e.e2e_helpers import (
    client,
    create,
    events,
    kill9_engine_core,
    pods,
    record,
    service_url,
    status,
    wait_ready,
)
from tests.engine import lora_peft

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
NAME = "lora"


def _adapter(name: str, source: str) -> dict:
    return {"apiVersion": "shoal.dev/v1alpha1", "kind": "InferenceAdapter",
            "metadata": {"name": name}, "spec": {"engine": NAME, "source": source}}


def _adapter_status(cluster, ns: str, name: str) -> dict:
    return cluster.get("inferenceadapter", name, "-n", ns).get("status") or {}


def _listed(pod: dict) -> set[str]:
    """The adapters a group's rank 0 lists in its own /v1/models."""
    import json

    url = f"http://{pod['status']['podIP']}:8000/v1/models"
    with urllib.request.urlopen(url, timeout=10) as r:
        cards = json.loads(r.read())["data"]
    return {c["id"] for c in cards if c.get("parent")}


def _rank0(cluster, ns: str, group: int) -> dict:
    (p,) = pods(cluster, ns, f"shoal.dev/engine={NAME},shoal.dev/group={group},"
                             "shoal.dev/rank=0")
    return p


engine_with_adapters_host: dict = {}  # namespace -> the adapters' directory on the host


@pytest.fixture(scope="module")
def engine_with_adapters(cluster):
    made = MODEL_HOST_DIR / f"adapters-{uuid.uuid4().hex[:6]}"
    base = str(MODEL_HOST_DIR / "shoal-tiny")
    for name, seed, rank in (("sql", 51, 4), ("wide", 52, 32), ("locked", 53, 4)):
        lora_peft.make_adapter(base, made / name, seed, r=rank)  # wide: above maxLoraRank 16
        for f in (made / name).iterdir():  # save_pretrained writes the weights 0600 (root's)
            f.chmod(0o644)
    (made / "locked" / "adapter_model.safetensors").chmod(0o600)  # unreadable by uid 10001
    ns = cluster.new_namespace("e2e-lora")
    create(cluster, ns, NAME, replicas=2, lora={"maxLoras": 2})
    wait_ready(cluster, ns, NAME, "2/2")
    engine_with_adapters_host[ns] = made
    try:
        yield ns, f"{MODEL_MOUNT}/{made.name}"
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        shutil.rmtree(made, ignore_errors=True)


def test_an_adapter_applied_to_a_running_engine_serves_on_every_group(cluster,
                                                                     engine_with_adapters):
    ns, root = engine_with_adapters
    t0 = time.monotonic()
    cluster.apply({**_adapter("sql", f"{root}/sql"), "metadata": {"name": "sql",
                                                                  "namespace": ns}})
    st = wait_for(lambda: (s := _adapter_status(cluster, ns, "sql")).get("phase") == "Ready"
                  and s, timeout=120, interval=0.5, what="InferenceAdapter sql Ready")
    record("adapter_apply_to_ready", time.monotonic() - t0)
    assert st["loaded"] == "2/2" and st["loadedGroups"] == [0, 1]
    assert {c["type"]: c["status"] for c in st["conditions"]} == {"Loaded": "True",
                                                                  "Ready": "True"}
    assert all("sql" in _listed(_rank0(cluster, ns, g)) for g in (0, 1))
    loaded = events(cluster, ns, "Loaded", "sql")
    assert sorted(e["message"].split(" from ")[0] for e in loaded) == [
        "loaded on group 0", "loaded on group 1"]
    url = service_url(cluster, ns, NAME)
    for _ in range(4):  # both groups have it: every request through the Service answers
        out = client(url, timeout=60).completions.create(model="sql", prompt="SELECT",
                                                          max_tokens=4)
        assert out.model == "sql" and out.choices[0].text
    models = {m.id: m for m in client(url).models.list().data}
    assert "sql" in models and "shoal-tiny" in models


def test_a_restarted_group_has_its_adapter_before_it_is_ready(cluster, engine_with_adapters):
    ns, _ = engine_with_adapters
    before = _rank0(cluster, ns, 1)
    kill9_engine_core(cluster, ns, before["metadata"]["name"])

    def back():
        groups = {g["index"]: g for g in status(cluster, ns, NAME).get("groups") or []}
        g1 = groups.get(1) or {}
        if g1.get("phase") != "Ready" or g1.get("restarts", 0) < 1:
            return None
        return _rank0(cluster, ns, 1)

    t0 = time.monotonic()
    pod = wait_for(back, timeout=300, interval=0.5, what="group 1 Ready again")
    record("adapter_group_restart_to_ready", time.monotonic() - t0)
    assert pod["metadata"]["uid"] != before["metadata"]["uid"]
    assert "sql" in _listed(pod)  # loaded before the group counted as Ready
    wait_for(lambda: _adapter_status(cluster, ns, "sql").get("loaded") == "2/2", timeout=60,
             interval=0.5, what="sql loaded 2/2 again")


def test_an_adapter_the_engine_refuses_is_failed_for_good_naming_the_rank(
        cluster, engine_with_adapters):
    ns, root = engine_with_adapters
    cluster.apply({**_adapter("wide", f"{root}/wide"), "metadata": {"name": "wide",
                                                                    "namespace": ns}})
    st = wait_for(lambda: (s := _adapter_status(cluster, ns, "wide")).get("phase") == "Failed"
                  and s, timeout=120, interval=0.5, what="InferenceAdapter wide Failed")
    err = st["lastError"]
    assert err["permanent"] is True and err["reason"] == "AdapterInvalid"
    assert "32" in err["message"] and "16" in err["message"]
    assert st["loaded"] == "0/2"
    # the engine keeps serving, and both groups stayed Ready
    assert status(cluster, ns, NAME)["ready"] == "2/2"
    with pytest.raises(Exception) as info:
        client(service_url(cluster, ns, NAME)).completions.create(model="wide", prompt="x",
                                                                  max_tokens=2)
    assert "404" in str(info.value) or "does not exist" in str(info.value)


def test_an_unreadable_file_is_a_waiting_reason_retried_until_fixed(cluster,
                                                                   engine_with_adapters):
    ns, root = engine_with_adapters
    cluster.apply({**_adapter("locked", f"{root}/locked"), "metadata": {"name": "locked",
                                                                        "namespace": ns}})

    def named():
        err = _adapter_status(cluster, ns, "locked").get("lastError") or {}
        return err if "is not readable" in err.get("message", "") else None

    err = wait_for(named, timeout=60, interval=0.5, what="locked's lastError")
    assert err["reason"] == "AdapterNotFound" and err["permanent"] is False
    assert "-rw-------" in err["message"] and "uid 10001" in err["message"]
    assert _adapter_status(cluster, ns, "locked")["phase"] == "Loading"
    host = engine_with_adapters_host[ns]
    (host / "locked" / "adapter_model.safetensors").chmod(0o644)
    t0 = time.monotonic()
    wait_for(lambda: _adapter_status(cluster, ns, "locked").get("phase") == "Ready",
             timeout=60, interval=0.5, what="locked Ready once readable")
    record("adapter_fixed_to_ready", time.monotonic() - t0)


def test_deleting_an_adapter_unloads_it_from_every_group(cluster, engine_with_adapters):
    ns, _ = engine_with_adapters
    cluster.kubectl("delete", "inferenceadapter", "sql", "-n", ns, "--wait=true", timeout=120)
    assert all("sql" not in _listed(_rank0(cluster, ns, g)) for g in (0, 1))
    url = service_url(cluster, ns, NAME)
    wait_for(lambda: "sql" not in {m.id for m in client(url).models.list().data}, timeout=30,
             interval=0.5, what="the Service to stop listing sql")
