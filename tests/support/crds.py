"""Install (or update) every generated CRD on a test API server and wait until discovery serves
their resources: the operator watches both kinds."""

from __future__ import annotations

import yaml
from shoal.operator import crd
from shoal.operator import labels as L
from shoal.operator.kube import Kube
from support.wait import wait_for

URL = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


def install(kube: Kube) -> dict:
    """Returns the InferenceEngine's manifest as installed."""
    manifests = [yaml.safe_load(crd.render_yaml(c)) for c in crd.crds()]
    for manifest in manifests:
        name = manifest["metadata"]["name"]
        have = kube.get("apiextensions.k8s.io/v1", "customresourcedefinitions", None, name)
        if have is None:
            kube.request("POST", URL, body=manifest)
        else:
            manifest["metadata"]["resourceVersion"] = have["metadata"]["resourceVersion"]
            kube.request("PUT", f"{URL}/{name}", body=manifest)

        def established(name=name):
            got = kube.request("GET", f"{URL}/{name}")
            return any(c["type"] == "Established" and c["status"] == "True"
                       for c in (got.get("status") or {}).get("conditions") or [])

        wait_for(established, timeout=30, interval=0.2, what=f"the CRD {name} to be established")
    plurals = {m["spec"]["names"]["plural"] for m in manifests}
    wait_for(lambda: plurals <= kube.resources(L.API_VERSION), timeout=60, interval=0.2,
             what=f"discovery to serve {', '.join(sorted(plurals))}")
    return manifests[0]
