"""An InferenceAdapter, read once per pass: its identity, the InferenceEngine it names, its
source, and where that source is inside the engine's pods.

Why a kind of its own rather than a list on InferenceEngine (docs/operator.md, "Adapters"): an
application team owns its adapter (RBAC on `inferenceadapters` alone, its own status and Events,
created and deleted without touching the platform team's engine), the engine's pods never roll
for an adapter (it is loaded at runtime through vLLM's endpoint), and one bad adapter reports on
its own object instead of making the engine's spec invalid. This is AIBrix's `ModelAdapter` and
production-stack's `LoraAdapter` shape; KServe's `model.lora.adapters` list is the other one.

The forms of `spec.source` today:
- a path inside the engine container (`/models/adapters/sql`: on the model volume);
- `pvc://CLAIM/PATH` where CLAIM is mounted in the engine's pods already (the model's own
  pvc:// claim, or `spec.modelVolume`'s claim): an adapter never adds a volume, which would
  restart every group;
- `hf://ORG/NAME`: the repo id goes to vLLM's load endpoint, and the engine downloads it from
  the hub (HF_ENDPOINT, HF_TOKEN of the engine container) at its default revision, as vLLM
  does; a revision is refused by the schema (the endpoint takes none). The engines of an hf://
  model run offline (HF_HUB_OFFLINE=1): there such an adapter waits, its status saying so.
The schema refuses every other form at apply (oci://: an image cannot be mounted into pods
that run; put the adapter on a volume the pods mount).
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass

from shoal.contract.model_fetch import HF_REPO_PATTERN
from shoal.operator import labels as L
from shoal.operator.model_source import PVC_MOUNT_DIR, PVC_PATTERN
from shoal.operator.spec import EngineSpec

# An absolute path with no `..` segment, or pvc://CLAIM/PATH (model_source's pattern). RE2.
_SEG = r"([^./][^/]*|\.[^./][^/]*|\.\.[^/]+)"
PATH_PATTERN = rf"/({_SEG}(/{_SEG})*/?)?"
SOURCE_PATTERN = rf"^({PVC_PATTERN}|{HF_REPO_PATTERN}|{PATH_PATTERN})$"
# What a name may be: vLLM takes any string; a DNS-1123 subdomain is what metadata.name is.
_PVC = re.compile(r"^pvc://([^/]+)/(.+)$")


@dataclass(frozen=True)
class AdapterRef:
    """Which InferenceAdapter: what its status patch and Events name (events.emit reads the
    same attributes as on an EngineRef)."""

    name: str
    namespace: str
    uid: str | None = None
    api_version: str = L.API_VERSION
    kind: str = L.ADAPTER_KIND

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class Adapter:
    ref: AdapterRef
    engine: str  # the InferenceEngine in the same namespace
    source: str
    generation: int
    deleting: bool
    status: dict  # as last written

    @property
    def name(self) -> str:
        """The name clients put in `model` (vLLM's lora_name): the object's name."""
        return self.ref.name

    @classmethod
    def of(cls, body: dict) -> Adapter:
        meta, spec = body["metadata"], body.get("spec") or {}
        ref = AdapterRef(meta["name"], meta["namespace"], meta.get("uid"))
        return cls(ref=ref, engine=str(spec.get("engine") or ""),
                   source=str(spec.get("source") or ""), generation=meta.get("generation", 0),
                   deleting=bool(meta.get("deletionTimestamp")),
                   status=dict(body.get("status") or {}))


def _volume_claims(spec: EngineSpec) -> dict[str, str]:
    """claim -> where it is mounted in every engine container."""
    out = {}
    if spec.source.is_pvc:
        out[spec.source.claim] = PVC_MOUNT_DIR
    pvc = ((spec.model_volume or {}).get("volume") or {}).get("persistentVolumeClaim") or {}
    if pvc.get("claimName"):
        out.setdefault(str(pvc["claimName"]), spec.model_mount_path)
    return out


def engine_path(adapter: Adapter, spec: EngineSpec) -> tuple[str | None, str]:
    """The adapter's directory inside the engine's containers, or (None, why not): a reason the
    user fixes on the adapter or the engine, so it is a waiting reason, never permanent."""
    if not re.fullmatch(SOURCE_PATTERN, adapter.source):
        return None, (f"spec.source {adapter.source!r} is not an absolute path or "
                      "pvc://CLAIM/PATH")
    if adapter.source.startswith("hf://"):  # the engine downloads it (a repo id, as vLLM)
        return adapter.source.removeprefix("hf://"), ""
    found = _PVC.match(adapter.source)
    if not found:
        return posixpath.normpath(adapter.source), ""
    claim, path = found.groups()
    mounts = _volume_claims(spec)
    if claim not in mounts:
        where = ", ".join(sorted(mounts)) or "none"
        return None, (f"the claim {claim!r} is not mounted in the pods of InferenceEngine "
                      f"{adapter.engine!r} (mounted claims: {where}); use the model's claim "
                      "or spec.modelVolume's, or a path")
    return posixpath.join(mounts[claim], path), ""

