"""The API group, kind, labels and ports that the operator puts on objects and that the routers,
the chart's monitors and users select on (`kubectl get pods -l shoal.dev/engine=my-llm`).

They are API: never rename one. Annotations the operator alone reads stay in
`shoal.operator.labels`.
"""

from __future__ import annotations

GROUP = "shoal.dev"
VERSION = "v1alpha1"
PLURAL = "inferenceengines"
KIND = "InferenceEngine"
API_VERSION = f"{GROUP}/{VERSION}"

LABEL_ENGINE = "shoal.dev/engine"  # the InferenceEngine's name, on every child
LABEL_COMPONENT = "shoal.dev/component"  # COMPONENT_FRONTEND | COMPONENT_ENGINE
LABEL_GROUP = "shoal.dev/group"  # engine group index, "0".."replicas-1"
LABEL_RANK = "shoal.dev/rank"  # rank within the group, "0" is the leader (EngineCore)
LABEL_REVISION = "shoal.dev/revision"  # hash of the engine spec the pod was rendered from
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "shoal-operator"

COMPONENT_FRONTEND = "frontend"
COMPONENT_ENGINE = "engine"

# The OpenAI HTTP port of every frontend and every rank 0 (and of the Services in front).
HTTP_PORT = 8000

# What the gateway lists to find every InferenceEngine's frontends (and so their discovery).
FRONTEND_SELECTOR = (f"{LABEL_MANAGED_BY}={MANAGED_BY},"
                     f"{LABEL_COMPONENT}={COMPONENT_FRONTEND}")
