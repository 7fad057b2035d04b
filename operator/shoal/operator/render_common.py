"""What every rendered child shares: labels, metadata with the owner reference, the hash
annotation that says when a child must be rewritten, and the grace period."""

from __future__ import annotations

from shoal.operator import labels as L
from shoal.operator.spec import ROUTER_IMAGE, EngineRef, EngineSpec, content_hash

SHUTDOWN_MARGIN_SECONDS = 15  # SIGTERM -> SIGKILL slack beyond the drain: abort outputs, cleanup


def common_labels(name: str, component: str) -> dict:
    return {L.LABEL_ENGINE: name, L.LABEL_COMPONENT: component,
            L.LABEL_MANAGED_BY: L.MANAGED_BY}


def engine_selector(name: str) -> dict:
    return {L.LABEL_ENGINE: name, L.LABEL_COMPONENT: L.COMPONENT_ENGINE}


def selector_string(name: str) -> str:
    return ",".join(f"{k}={v}" for k, v in engine_selector(name).items())


def metadata(ref: EngineRef, name: str, component: str,
             extra_labels: dict | None = None) -> dict:
    return {
        "name": name,
        "namespace": ref.namespace,
        "labels": {**common_labels(ref.name, component), **(extra_labels or {})},
        "ownerReferences": [ref.owner_reference()],
    }


def with_hash(obj: dict, payload) -> dict:
    obj["metadata"].setdefault("annotations", {})[L.ANNOTATION_SPEC_HASH] = content_hash(payload)
    return obj


def grace_seconds(spec: EngineSpec) -> int:
    """terminationGracePeriodSeconds >= drain time + margin: the drain is never cut short."""
    return spec.shutdown_timeout_seconds + SHUTDOWN_MARGIN_SECONDS


def shoal_init_image(spec: EngineSpec) -> str:
    """The Shoal router image the operator's own init containers run (`model-fetch`,
    `install-supervisor`): one setting, SHOAL_FETCH_IMAGE, else the release's router image."""
    return spec.settings.fetch_image or ROUTER_IMAGE
