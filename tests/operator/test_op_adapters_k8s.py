"""InferenceAdapter through the real operator on a real API server: the schema refuses a source
form the operator does not implement, an adapter reports why nothing loads (no engine, an
engine without spec.lora) in its status, and a delete completes (the finalizer goes)."""

from __future__ import annotations

import pytest
from shoal.operator import labels as L
from support.builders import engine
from support.engine_api import api_error, condition, create_ie
from support.wait import wait_for

pytestmark = pytest.mark.k8s


def _create(kube, ns: str, name: str, engine_name: str, source: str) -> dict:
    body = {"apiVersion": L.API_VERSION, "kind": L.ADAPTER_KIND,
            "metadata": {"name": name, "namespace": ns},
            "spec": {"engine": engine_name, "source": source}}
    return kube.request("POST", f"/apis/{L.API_VERSION}/namespaces/{ns}/{L.ADAPTER_PLURAL}",
                        body=body)


def _get(kube, ns: str, name: str) -> dict | None:
    return kube.get(L.API_VERSION, L.ADAPTER_PLURAL, ns, name)


def _waiting(kube, ns: str, name: str, says: str) -> dict:
    def check():
        a = _get(kube, ns, name)
        c = condition(a, "Loaded")
        return a if says in c.get("message", "") else None
    return wait_for(check, timeout=30, interval=0.2, what=f"adapter {name} to say {says!r}")


def test_the_schema_refuses_sources_the_operator_does_not_implement(kube, ns):
    for source in ("hf://org/sql-lora@v2", "oci://registry/sql", "relative/path"):
        err = api_error(lambda s=source: _create(kube, ns, "bad", "llm", s))
        assert err.status == 422 and "spec.source" in err.body


def test_an_adapter_says_why_nothing_loads_and_its_delete_completes(kube, ns):
    _create(kube, ns, "sql", "llm", "/models/adapters/sql")
    a = _waiting(kube, ns, "sql", "InferenceEngine 'llm' not found")
    st = a["status"]
    assert st["phase"] == "Pending" and condition(a, "Ready")["status"] == "False"
    assert a["metadata"].get("finalizers")  # the operator unloads it before it goes

    create_ie(kube, engine("llm", ns).obj())
    a = _waiting(kube, ns, "sql", "has no spec.lora")
    assert a["status"]["phase"] == "Pending"

    kube.delete(L.API_VERSION, L.ADAPTER_PLURAL, ns, "sql")
    wait_for(lambda: _get(kube, ns, "sql") is None, timeout=30, interval=0.2,
             what="the adapter's finalizer to go")
