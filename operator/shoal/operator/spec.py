"""EngineSpec: an InferenceEngine's spec as one typed, frozen object, built once per pass from
the resource body. Every default is defined here once: crd.py writes the same values into the
schema (so the API server fills them in), and the operator falls back on them for a body the
API server did not default (an object from before a field existed, a test's plain dict).

Pass-through parts (resources, env, extraArgs, the model volume source) stay plain dicts in
`raw`: the operator copies them into pods without reading them.
"""

from __future__ import annotations

from dataclasses import dataclass

# Dotted path under `spec` -> default. The CRD schema's `default:` values come from here.
DEFAULTS: dict[str, object] = {
    "image": "ghcr.io/shoal-dev/shoal:0.1.0",
    "imagePullPolicy": "IfNotPresent",
    "runtime": "Shoal",
    "replicas": 1,
    "tensorParallelSize": 1,
    "nodesPerGroup": 1,
    "masterPort": 29500,
    "frontend.replicas": 1,
    "frontend.routing": "least-outstanding",
    "engine.startupTimeoutSeconds": 1200,
    "modelVolume.mountPath": "/models",
    "shutdown.timeoutSeconds": 30,
    "restartPolicy.policy": "RecreateGroupOnFailure",
    "restartPolicy.backoffBaseSeconds": 10,
    "restartPolicy.backoffMaxSeconds": 300,
    "restartPolicy.maxRestarts": 10,
    "restartPolicy.resetAfterSeconds": 600,
}


def _get(spec: dict, path: str):
    node = spec
    *parents, leaf = path.split(".")
    for key in parents:
        node = node.get(key) or {}
    value = node.get(leaf)
    return DEFAULTS[path] if value is None else value


@dataclass(frozen=True)
class RestartPolicy:
    policy: str
    backoff_base_seconds: int
    backoff_max_seconds: int
    max_restarts: int  # 0 = no limit
    reset_after_seconds: int

    @property
    def never(self) -> bool:
        return self.policy == "Never"


@dataclass(frozen=True)
class EngineSpec:
    raw: dict  # the body's spec as it is (pass-through parts)
    model: str
    served_model_name: str
    image: str
    image_pull_policy: str
    runtime: str
    runtime_version: str  # "" = unset (a VLLM group then reads its release from the image tag)
    replicas: int
    tensor_parallel_size: int
    nodes_per_group: int
    master_port: int
    frontend_replicas: int
    frontend_image: str
    frontend_routing: str  # least-outstanding | prefix-affinity
    startup_timeout_seconds: int
    model_mount_path: str
    shutdown_timeout_seconds: int  # 0 = abort at once
    restart: RestartPolicy

    @classmethod
    def of(cls, body: dict) -> EngineSpec:
        spec = body.get("spec") or {}
        image = str(_get(spec, "image"))
        runtime = str(_get(spec, "runtime"))
        # Frontends always run `shoal serve`: a stock vLLM image cannot be theirs.
        frontend_default = image if runtime != "VLLM" else str(DEFAULTS["image"])
        return cls(
            raw=spec,
            model=str(spec.get("model") or ""),
            served_model_name=str(spec.get("servedModelName") or spec.get("model") or ""),
            image=image,
            image_pull_policy=str(_get(spec, "imagePullPolicy")),
            runtime=runtime,
            runtime_version=str(spec.get("runtimeVersion") or ""),
            replicas=int(_get(spec, "replicas")),
            tensor_parallel_size=int(_get(spec, "tensorParallelSize")),
            nodes_per_group=int(_get(spec, "nodesPerGroup")),
            master_port=int(_get(spec, "masterPort")),
            frontend_replicas=int(_get(spec, "frontend.replicas")),
            frontend_image=str((spec.get("frontend") or {}).get("image") or frontend_default),
            frontend_routing=str(_get(spec, "frontend.routing")),
            startup_timeout_seconds=int(_get(spec, "engine.startupTimeoutSeconds")),
            model_mount_path=str(_get(spec, "modelVolume.mountPath")),
            shutdown_timeout_seconds=int(_get(spec, "shutdown.timeoutSeconds")),
            restart=RestartPolicy(
                policy=str(_get(spec, "restartPolicy.policy")),
                backoff_base_seconds=int(_get(spec, "restartPolicy.backoffBaseSeconds")),
                backoff_max_seconds=int(_get(spec, "restartPolicy.backoffMaxSeconds")),
                max_restarts=int(_get(spec, "restartPolicy.maxRestarts")),
                reset_after_seconds=int(_get(spec, "restartPolicy.resetAfterSeconds")),
            ),
        )
