"""Small builders for InferenceEngine test objects (LWS style: `engine("llm").groups(2).obj()`)."""

from __future__ import annotations

import copy
import uuid

from shoal.operator import labels as L


class EngineBuilder:
    def __init__(self, name: str = "llm", namespace: str = "ns"):
        self._body = {
            "apiVersion": L.API_VERSION,
            "kind": L.KIND,
            "metadata": {"name": name, "namespace": namespace, "uid": str(uuid.uuid4()), "generation": 1},
            "spec": {"model": "/models/tiny", "servedModelName": "tiny", "image": "shoal:test"},
        }

    def groups(self, n: int) -> EngineBuilder:
        self._body["spec"]["replicas"] = n
        return self

    def ranks(self, nodes: int, tp: int | None = None) -> EngineBuilder:
        self._body["spec"]["nodesPerGroup"] = nodes
        self._body["spec"]["tensorParallelSize"] = tp or nodes
        return self

    def drain(self, seconds: int) -> EngineBuilder:
        self._body["spec"]["shutdown"] = {"timeoutSeconds": seconds}
        return self

    def restart(self, **policy) -> EngineBuilder:
        self._body["spec"]["restartPolicy"] = policy
        return self

    def set(self, **fields) -> EngineBuilder:
        self._body["spec"].update(fields)
        return self

    def obj(self) -> dict:
        return copy.deepcopy(self._body)

    def manifest(self) -> dict:
        """Without uid/generation: what a user would `kubectl apply`."""
        body = self.obj()
        body["metadata"] = {"name": body["metadata"]["name"], "namespace": body["metadata"]["namespace"]}
        return body


def engine(name: str = "llm", namespace: str = "ns") -> EngineBuilder:
    return EngineBuilder(name, namespace)
