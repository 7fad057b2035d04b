"""Every label, annotation and name the operator puts on objects, as named constants.

Users select on the labels (`kubectl get pods -l shoal.dev/engine=my-llm,shoal.dev/rank=0`);
the operator selects on them too, so they are API: never rename one.
"""

from __future__ import annotations

# The API identity, the selectable labels and the HTTP port are shared with the routers and
# the chart: they live in shoal.contract.labels and are re-exported here for the operator.
from shoal.contract.labels import (  # noqa: F401
    API_VERSION,
    COMPONENT_ENGINE,
    COMPONENT_FRONTEND,
    GROUP,
    HTTP_PORT,
    KIND,
    LABEL_COMPONENT,
    LABEL_ENGINE,
    LABEL_GROUP,
    LABEL_MANAGED_BY,
    LABEL_RANK,
    LABEL_REVISION,
    MANAGED_BY,
    PLURAL,
    VERSION,
)

# Annotations (not selectable).
ANNOTATION_SPEC_HASH = "shoal.dev/spec-hash"  # hash of the rendered object: changed => rewrite

DEFAULT_MASTER_PORT = 29500  # = spec.DEFAULTS["masterPort"] (the engines' default too)

# Container names.
ENGINE_CONTAINER = "engine"
FRONTEND_CONTAINER = "frontend"

def frontend_name(name: str) -> str:
    return f"{name}-frontend"


def service_name(name: str) -> str:
    """The ClusterIP Service: the in-cluster OpenAI endpoint."""
    return name


def ranks_service_name(name: str) -> str:
    """The headless Service giving every rank a stable DNS name."""
    return f"{name}-ranks"


def pdb_name(name: str) -> str:
    return f"{name}-engines"


def pod_name(name: str, group: int, rank: int) -> str:
    return f"{name}-g{group}-r{rank}"


def rank_host(name: str, namespace: str, group: int, rank: int) -> str:
    """Stable DNS name of one rank: hostname.subdomain.namespace.svc (no cluster domain, so it
    works whatever the cluster's domain is)."""
    return f"{pod_name(name, group, rank)}.{ranks_service_name(name)}.{namespace}.svc"


def endpoint_url(name: str, namespace: str) -> str:
    return f"http://{service_name(name)}.{namespace}.svc:{HTTP_PORT}/v1"


# Pod names become hostnames (63 chars): "<name>-g<group>-r<rank>" must fit.
MAX_NAME_LENGTH = 45


# The InferenceAdapter kind (adapter_spec.py), in the same API group and version.
ADAPTER_KIND = "InferenceAdapter"
ADAPTER_PLURAL = "inferenceadapters"
