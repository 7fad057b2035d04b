"""Every label, annotation and name the operator puts on objects, as named constants.

Users select on the labels (`kubectl get pods -l shoal.dev/engine=my-llm,shoal.dev/rank=0`);
the operator selects on them too, so they are API: never rename one.
"""

from __future__ import annotations

GROUP = "shoal.dev"
VERSION = "v1alpha1"
PLURAL = "inferenceengines"
KIND = "InferenceEngine"
API_VERSION = f"{GROUP}/{VERSION}"

# Labels (selectable).
LABEL_ENGINE = "shoal.dev/engine"  # the InferenceEngine's name, on every child
LABEL_COMPONENT = "shoal.dev/component"  # COMPONENT_FRONTEND | COMPONENT_ENGINE
LABEL_GROUP = "shoal.dev/group"  # engine group index, "0".."replicas-1"
LABEL_RANK = "shoal.dev/rank"  # rank within the group, "0" is the leader (EngineCore)
LABEL_REVISION = "shoal.dev/revision"  # hash of the engine spec the pod was rendered from
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "shoal-operator"

COMPONENT_FRONTEND = "frontend"
COMPONENT_ENGINE = "engine"

# Annotations (not selectable).
ANNOTATION_SPEC_HASH = "shoal.dev/spec-hash"  # hash of the rendered object: changed => rewrite
ANNOTATION_DRAIN_STARTED = "shoal.dev/drain-started"  # when rank 0 was asked to drain
ANNOTATION_STOP_REQUESTED = "shoal.dev/stop-requested"  # the operator asked this pod to stop

# Ports.
HTTP_PORT = 8000
DEFAULT_MASTER_PORT = 29500  # = spec.DEFAULTS["masterPort"] (the engines' default too)

# Container names.
ENGINE_CONTAINER = "engine"
FRONTEND_CONTAINER = "frontend"

# Where the frontends read the list of ready engine groups (see render.discovery_configmap).
DISCOVERY_MOUNT = "/etc/shoal/discovery"
DISCOVERY_FILE = "engines.json"


def frontend_name(name: str) -> str:
    return f"{name}-frontend"


def service_name(name: str) -> str:
    """The ClusterIP Service: the in-cluster OpenAI endpoint."""
    return name


def ranks_service_name(name: str) -> str:
    """The headless Service giving every rank a stable DNS name."""
    return f"{name}-ranks"


def discovery_name(name: str) -> str:
    return f"{name}-engines"


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
