"""One small REST client over the official kubernetes client: plain dicts in and out, and a
count of every write by (verb, resource), so tests and the benchmark can see exactly what a
reconcile pass wrote, and of every read (GET, LIST), so the benchmark can report API calls.

Plain dicts keep the reconciler in the same shape as `render.py` (camelCase manifests), and one
generic path builder covers core, apps, policy (v1 and v1beta1) and our own resource without
per-kind client classes (the client no longer ships policy/v1beta1).
"""

from __future__ import annotations

import json
import threading
from collections import Counter

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

PLURALS = {"Pod": "pods", "Service": "services", "ConfigMap": "configmaps", "Event": "events",
           "Deployment": "deployments", "PodDisruptionBudget": "poddisruptionbudgets",
           "InferenceEngine": "inferenceengines", "ServiceAccount": "serviceaccounts",
           "Role": "roles", "RoleBinding": "rolebindings", "Lease": "leases"}


def load_config() -> client.ApiClient:
    """In a pod: the service account; elsewhere: $KUBECONFIG / ~/.kube/config."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


def path(api_version: str, plural: str, namespace: str | None = None, name: str | None = None,
         sub: str | None = None) -> str:
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    p = base + (f"/namespaces/{namespace}" if namespace else "") + f"/{plural}"
    p += f"/{name}" if name else ""
    return p + (f"/{sub}" if sub else "")


class Kube:
    def __init__(self, api_client: client.ApiClient | None = None):
        self.api = api_client or load_config()
        self.writes: Counter = Counter()  # (verb, plural) -> count
        self.reads: Counter = Counter()  # ("get" | "list", plural) -> count
        self._lock = threading.Lock()

    def request(self, method: str, url: str, *, body=None, query: dict | None = None,
                content_type: str = "application/json"):
        params = self.api.param_serialize(
            method=method, resource_path=url, query_params=list((query or {}).items()),
            header_params={"Accept": "application/json", "Content-Type": content_type},
            body=body, auth_settings=["BearerToken"])
        resp = self.api.call_api(*params)
        data = resp.read()
        if not 200 <= resp.status < 300:
            raise ApiException(status=resp.status, reason=resp.reason, http_resp=resp)
        return json.loads(data) if data else None

    def _count(self, verb: str, plural: str, counter: Counter | None = None) -> None:
        with self._lock:
            (self.writes if counter is None else counter)[(verb, plural)] += 1

    # reads
    def get(self, api_version: str, plural: str, namespace: str, name: str) -> dict | None:
        self._count("get", plural, self.reads)
        try:
            return self.request("GET", path(api_version, plural, namespace, name))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def list(self, api_version: str, plural: str, namespace: str | None,
             selector: str = "") -> list[dict]:
        self._count("list", plural, self.reads)
        query = {"labelSelector": selector} if selector else {}
        return self.request("GET", path(api_version, plural, namespace), query=query)["items"]

    def log_tail(self, namespace: str, pod: str, container: str, lines: int) -> str:
        """The last `lines` lines of one container's log ("" when there is none yet)."""
        self._count("get", "pods/log", self.reads)
        params = self.api.param_serialize(
            method="GET", resource_path=path("v1", "pods", namespace, pod, "log"),
            query_params=[("container", container), ("tailLines", str(lines))],
            header_params={"Accept": "text/plain"}, auth_settings=["BearerToken"])
        resp = self.api.call_api(*params)
        data = resp.read()
        if resp.status in (400, 404):  # not started yet, or gone
            return ""
        if not 200 <= resp.status < 300:
            raise ApiException(status=resp.status, reason=resp.reason, http_resp=resp)
        return data.decode(errors="replace")

    # writes (each counted)
    def create(self, obj: dict) -> dict | None:
        """Create; an object that already exists (409) is not an error: names are deterministic,
        so a second operator pass or a restarted operator never makes a duplicate."""
        plural = PLURALS[obj["kind"]]
        self._count("create", plural)
        try:
            url = path(obj["apiVersion"], plural, obj["metadata"].get("namespace"))
            return self.request("POST", url, body=obj)
        except ApiException as e:
            if e.status == 409:
                return None
            raise

    def patch(self, api_version: str, plural: str, namespace: str, name: str, patch: dict,
              sub: str | None = None) -> dict | None:
        self._count("patch" if not sub else f"patch/{sub}", plural)
        try:
            return self.request(
                "PATCH",
                path(api_version, plural, namespace, name, sub),
                body=patch,
                content_type="application/merge-patch+json",
            )
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def replace(self, obj: dict) -> dict:
        plural = PLURALS[obj["kind"]]
        self._count("update", plural)
        meta = obj["metadata"]
        url = path(obj["apiVersion"], plural, meta["namespace"], meta["name"])
        return self.request("PUT", url, body=obj)

    def delete(self, api_version: str, plural: str, namespace: str, name: str,
               grace_seconds: int | None = None, uid: str | None = None) -> bool:
        """Delete; 404 is success. `uid` makes it a precondition, so a pod recreated under the
        same name by another pass is never deleted by mistake."""
        self._count("delete", plural)
        body: dict = {"propagationPolicy": "Background"}
        if grace_seconds is not None:
            body["gracePeriodSeconds"] = grace_seconds
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            self.request("DELETE", path(api_version, plural, namespace, name), body=body)
            return True
        except ApiException as e:
            if e.status in (404, 409):
                return False
            raise

    def resources(self, group_version: str) -> set[str]:
        """Plural resource names the server serves for one group/version (API discovery)."""
        try:
            found = self.request("GET", path(group_version, "").rstrip("/"))
            return {r["name"] for r in found["resources"]}
        except ApiException as e:
            if e.status == 404:
                return set()
            raise
