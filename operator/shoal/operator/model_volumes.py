"""The model's part of an engine pod, per model source (model_source.py): the volumes, the init
container that brings the model in, and what the engine container mounts, reads from its
environment and is started on. Pure builders, table-tested
(tests/operator/test_op_model_volumes.py).

- a path or name: spec.modelVolume (if any) read-only at its mountPath;
- pvc://CLAIM/PATH: the claim read-only at PVC_MOUNT_DIR;
- hf://ORG/NAME@REV: the model cache (spec.modelCache: a shared PVC, a per-node hostPath, or an
  emptyDir per pod) at CACHE_MOUNT, read-write in the `model-fetch` init container (`shoal
  fetch`, the real huggingface_hub client) and read-only in the engine, which starts on the repo
  id offline from that cache, as vLLM does (`--revision REV --download-dir CACHE_DIR`,
  HF_HUB_OFFLINE=1, HF_HUB_CACHE=CACHE_DIR for the config and tokenizer);
- oci://IMAGE: the model image's OCI_MODEL_DIR at OCI_MOUNT_DIR, either as an image volume
  (settings.image_volumes: the node's image store is the cache) or copied by an init container
  of that image into an emptyDir (`cp -a`: the image needs a `cp`, as KServe's modelcars have).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.contract import model_fetch as mf
from shoal.contract.termination import DEFAULT_PATH as TERMINATION_MESSAGE_PATH
from shoal.operator.model_source import OCI_MODEL_DIR, OCI_MOUNT_DIR, PVC_MOUNT_DIR
from shoal.operator.render_common import shoal_init_image
from shoal.operator.spec import EngineSpec

MODEL_VOLUME = "model"
OCI_COPY_CONTAINER = "model-image"  # the oci:// init container (copy mode)
FETCH_RESOURCES = {"requests": {"cpu": "100m", "memory": "256Mi"},
                   "limits": {"memory": "2Gi"}}
# The init containers and volumes the operator owns in an engine pod (a template may not
# name them).
OWNED_INIT_CONTAINERS = {
    mf.FETCH_CONTAINER: "it downloads spec.model (hf://) into the model cache",
    OCI_COPY_CONTAINER: "it copies spec.model (oci://) into the pod",
}


@dataclass(frozen=True)
class ModelParts:
    """What the model adds to one engine pod."""

    arg: str  # what `serve` is started on
    volumes: list[dict] = field(default_factory=list)
    init_containers: list[dict] = field(default_factory=list)
    mounts: list[dict] = field(default_factory=list)  # the engine container's
    env: list[dict] = field(default_factory=list)  # the engine container's
    args: list[str] = field(default_factory=list)  # engine flags after the model


def model_parts(spec: EngineSpec) -> ModelParts:
    source = spec.source
    if source.is_hf:
        return _hf(spec)
    if source.is_oci:
        return _oci(spec)
    if source.is_pvc:
        claim = {"claimName": source.claim, "readOnly": True}
        return _read_only(source.arg, {"persistentVolumeClaim": claim}, PVC_MOUNT_DIR)
    if spec.model_volume:
        return _read_only(source.arg, dict(spec.model_volume.get("volume") or {}),
                          spec.model_mount_path)
    return ModelParts(arg=source.arg)


def _read_only(arg: str, volume: dict, mount: str, sub_path: str = "") -> ModelParts:
    m = {"name": MODEL_VOLUME, "mountPath": mount, "readOnly": True}
    return ModelParts(arg=arg, volumes=[{"name": MODEL_VOLUME, **volume}],
                      mounts=[m | ({"subPath": sub_path} if sub_path else {})])


def cache_volume(spec: EngineSpec) -> dict:
    """spec.modelCache as a volume named CACHE_VOLUME; an emptyDir per pod when absent."""
    cache = spec.model_cache or {}
    if claim := (cache.get("persistentVolumeClaim") or {}).get("claimName"):
        return {"name": mf.CACHE_VOLUME, "persistentVolumeClaim": {"claimName": claim}}
    if path := (cache.get("hostPath") or {}).get("path"):
        return {"name": mf.CACHE_VOLUME, "hostPath": {"path": path, "type": "DirectoryOrCreate"}}
    return {"name": mf.CACHE_VOLUME, "emptyDir": {}}


def fetch_env(spec: EngineSpec) -> list[dict]:
    env = []
    if spec.model_auth:
        ref = {"name": str(spec.model_auth.get("secretName") or ""), "key": spec.token_key}
        env.append({"name": mf.TOKEN_ENV, "valueFrom": {"secretKeyRef": ref}})
    if spec.hf_endpoint:
        env.append({"name": mf.ENDPOINT_ENV, "value": spec.hf_endpoint})
    return env


def fetch_container(spec: EngineSpec, files: str = "engine") -> dict:
    """The `model-fetch` init container: `shoal fetch` (it locks, resumes, checks sizes and
    hashes, and names a failure's cause in its termination message); `files`: which of
    model_fetch.FILE_SETS (a kv-aware frontend's takes only the tokenizer's)."""
    assert spec.source.hub is not None
    return {
        "name": mf.FETCH_CONTAINER,
        "image": shoal_init_image(spec),
        "imagePullPolicy": spec.image_pull_policy,
        "command": mf.fetch_command(spec.source.hub, files),
        "env": fetch_env(spec),
        "volumeMounts": [{"name": mf.CACHE_VOLUME, "mountPath": mf.CACHE_MOUNT}],
        "resources": FETCH_RESOURCES,
        "terminationMessagePath": TERMINATION_MESSAGE_PATH,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def _hf(spec: EngineSpec) -> ModelParts:
    hub = spec.source.hub
    assert hub is not None
    return ModelParts(
        arg=hub.repo_id,
        volumes=[cache_volume(spec)],
        init_containers=[fetch_container(spec)],
        mounts=[{"name": mf.CACHE_VOLUME, "mountPath": mf.CACHE_MOUNT, "readOnly": True}],
        env=[{"name": "HF_HUB_OFFLINE", "value": "1"},
             {"name": "HF_HUB_CACHE", "value": mf.CACHE_DIR}],
        args=["--revision", hub.revision, "--download-dir", mf.CACHE_DIR],
    )


def _oci(spec: EngineSpec) -> ModelParts:
    image = spec.source.image
    if spec.settings.image_volumes:
        volume = {"image": {"reference": image, "pullPolicy": spec.image_pull_policy}}
        return _read_only(OCI_MOUNT_DIR, volume, OCI_MOUNT_DIR, OCI_MODEL_DIR.strip("/"))
    copy = {
        "name": OCI_COPY_CONTAINER,
        "image": image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["cp", "-a", f"{OCI_MODEL_DIR}/.", OCI_MOUNT_DIR],
        "volumeMounts": [{"name": MODEL_VOLUME, "mountPath": OCI_MOUNT_DIR}],
        "resources": FETCH_RESOURCES,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    parts = _read_only(OCI_MOUNT_DIR, {"emptyDir": {}}, OCI_MOUNT_DIR)
    return ModelParts(arg=parts.arg, volumes=parts.volumes, init_containers=[copy],
                      mounts=parts.mounts)
