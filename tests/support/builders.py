"""The suite's one builder of InferenceEngine objects (LWS style:
`engine("llm", ns).groups(2).ranks(2).drain(30).obj()`), for the operator's unit and API tests,
the gateway tests and the end-to-end tier.

It starts from a small test spec (model `/models/tiny`, image `shoal:test`) and every method
sets one part of it, so a test says only what it is about. The end-to-end tier's engine
(`support.cluster.inference_engine`) is expressible as:

    engine(name, namespace=None).set(model=f"{MODEL_MOUNT}/shoal-tiny", servedModelName=
        "shoal-tiny", image=ENGINE_IMAGE).groups(replicas).ranks(nodes, tp=tp).drain(shutdown_s)
        .model_volume(MODEL_MOUNT, {"hostPath": {"path": MODEL_HOST_DIR, "type": "Directory"}})
        .engine(extraArgs=[...], startupTimeoutSeconds=300, resources={...})
        .frontend(replicas=1, resources={...})
        .restart(backoffBaseSeconds=backoff_base, backoffMaxSeconds=30).manifest()
"""

from __future__ import annotations

import copy
import uuid

from shoal.contract.labels import API_VERSION, KIND


class EngineBuilder:
    def __init__(self, name: str = "llm", namespace: str | None = "ns"):
        meta = {"name": name, "uid": str(uuid.uuid4()), "generation": 1}
        if namespace is not None:
            meta["namespace"] = namespace
        self._body = {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "metadata": meta,
            "spec": {"model": "/models/tiny", "servedModelName": "tiny", "image": "shoal:test"},
        }

    def groups(self, n: int) -> EngineBuilder:
        """spec.replicas: how many engine groups."""
        self._body["spec"]["replicas"] = n
        return self

    def ranks(self, nodes: int, tp: int | None = None) -> EngineBuilder:
        """Pods per group, and the group's tensor-parallel size (default: one per pod)."""
        self._body["spec"]["nodesPerGroup"] = nodes
        self._body["spec"]["tensorParallelSize"] = tp or nodes
        return self

    def drain(self, seconds: int) -> EngineBuilder:
        self._body["spec"]["shutdown"] = {"timeoutSeconds": seconds}
        return self

    def restart(self, **policy) -> EngineBuilder:
        """spec.restartPolicy, as given (camelCase keys)."""
        self._body["spec"]["restartPolicy"] = policy
        return self

    def engine(self, **fields) -> EngineBuilder:
        """spec.engine, as given: extraArgs, env, resources, startupTimeoutSeconds."""
        self._body["spec"]["engine"] = fields
        return self

    def frontend(self, **fields) -> EngineBuilder:
        """spec.frontend, as given: replicas, image, routing, resources."""
        self._body["spec"]["frontend"] = fields
        return self

    def model_volume(self, mount_path: str, volume: dict) -> EngineBuilder:
        self._body["spec"]["modelVolume"] = {"mountPath": mount_path, "volume": volume}
        return self

    def set(self, **fields) -> EngineBuilder:
        """Any other top-level spec fields, as given."""
        self._body["spec"].update(fields)
        return self

    def obj(self) -> dict:
        """As the API server returns it (with uid and generation): what the operator reads."""
        return copy.deepcopy(self._body)

    def manifest(self) -> dict:
        """Without uid/generation: what a user would `kubectl apply`."""
        body = self.obj()
        body["metadata"] = {k: v for k, v in body["metadata"].items()
                            if k in ("name", "namespace")}
        return body


def engine(name: str = "llm", namespace: str | None = "ns") -> EngineBuilder:
    return EngineBuilder(name, namespace)
