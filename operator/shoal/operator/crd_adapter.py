"""The InferenceAdapter CustomResourceDefinition: a LoRA adapter an application team owns, served
by the InferenceEngine it names (adapter_spec.py says why it is a kind of its own). Rendered by
`python -m shoal.operator.crd --write` with the InferenceEngine's, in the same style."""

from __future__ import annotations

from shoal.operator import labels as L
from shoal.operator.adapter_spec import SOURCE_PATTERN
from shoal.operator.crd_status import _condition
from shoal.operator.model_source import PVC_MOUNT_DIR
from shoal.operator.openapi import obj, typed, values
from shoal.operator.phases import AdapterCondition, AdapterPhase

NAME = f"{L.ADAPTER_PLURAL}.{L.GROUP}"
FILE_NAME = f"{NAME}.yaml"

PRINTER_COLUMNS = [
    {"name": "Engine", "type": "string", "jsonPath": ".spec.engine",
     "description": "The InferenceEngine that serves it."},
    {"name": "Loaded", "type": "string", "jsonPath": ".status.loaded",
     "description": "Groups that have it loaded / serving groups."},
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase", "description": "Summary."},
    {"name": "Source", "type": "string", "jsonPath": ".spec.source",
     "description": "Where the adapter's files are."},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def _spec() -> dict:
    return obj(
        "spec names the engine and the adapter's files (PEFT's format: adapter_config.json and "
        "adapter_model.safetensors). Clients select the adapter with `model: NAME`, the "
        "object's name.",
        {
            "engine": typed("string", "engine is the InferenceEngine in this namespace that "
                            "serves the adapter; it needs `spec.lora`. Required. Example: "
                            "`llm`.", minLength=1, maxLength=253),
            "source": typed("string", "source is the adapter's directory: an absolute path "
                            "inside the engine containers (for example on `modelVolume`), or "
                            "`pvc://CLAIM/PATH` where CLAIM is already mounted in the engine's "
                            f"pods (the model's pvc:// claim, at `{PVC_MOUNT_DIR}`, or "
                            "`modelVolume`'s claim), or `hf://ORG/NAME`: downloaded by the "
                            "engine from the hub (its container's `HF_ENDPOINT`, `HF_TOKEN`) "
                            "at the default revision, as vLLM's load endpoint does (no "
                            "`@REVISION`). An adapter never adds a volume to the pods (that "
                            "would restart every group), so `oci://` is refused. Required. "
                            "Example: `/models/adapters/sql-lora`.", minLength=1,
                            pattern=SOURCE_PATTERN),
        },
        required=["engine", "source"],
    )


def _status() -> dict:
    return obj(
        "status is what the operator observed, per group of the engine.",
        {
            "phase": typed("string", "phase: " + ", ".join(values(AdapterPhase)) + ". Ready "
                           "only after a request for the adapter through the engine's "
                           "frontend Service succeeded.", enum=values(AdapterPhase)),
            "loaded": typed("string", "loaded is `k/N`: groups with the adapter loaded / the "
                            "engine's serving groups. Example: `2/2`."),
            "loadedGroups": typed("array", "loadedGroups are the group indices that list the "
                                  "adapter in their /v1/models.",
                                  items={"type": "integer", "format": "int32"}),
            "path": typed("string", "path is the directory the engines load, as resolved from "
                          "`spec.source`."),
            "lastError": obj(
                "lastError is the most recent load failure, in the engine's own words.",
                {
                    "group": typed("integer", "group that answered.", format="int32"),
                    "reason": typed("string", "reason, CamelCase: `AdapterInvalid` (the engine "
                                    "refused the adapter: rank, modules, base model; not "
                                    "retried until the spec changes), `AdapterNotFound` (the "
                                    "path is not there; retried), `EngineUnreachable`."),
                    "message": typed("string", "message is the engine's answer."),
                    "permanent": typed("boolean", "permanent is true when retrying cannot "
                                       "help."),
                    "time": typed("string", "time of the answer.", format="date-time"),
                },
            ),
            "conditions": {"type": "array", "description": "conditions: " + ", ".join(
                values(AdapterCondition)) + ".", "items": _condition()},
            "observedGeneration": typed("integer", "observedGeneration is the spec generation "
                                        "this status describes.", format="int64"),
        },
    )


def crd() -> dict:
    schema = obj("InferenceAdapter is a LoRA adapter served by an InferenceEngine's groups.",
                 {"apiVersion": typed("string", f"APIVersion of this object: `{L.API_VERSION}`."),
                  "kind": typed("string", f"Kind of this object: `{L.ADAPTER_KIND}`."),
                  "metadata": {"type": "object"}, "spec": _spec(), "status": _status()},
                 required=["spec"])
    names = {"plural": L.ADAPTER_PLURAL, "singular": "inferenceadapter",
             "kind": L.ADAPTER_KIND, "listKind": f"{L.ADAPTER_KIND}List",
             "shortNames": ["ia"], "categories": ["all", "shoal"]}
    version = {"name": L.VERSION, "served": True, "storage": True,
               "schema": {"openAPIV3Schema": schema}, "subresources": {"status": {}},
               "additionalPrinterColumns": PRINTER_COLUMNS}
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": NAME, "labels": {"app.kubernetes.io/part-of": "shoal"}},
        "spec": {"group": L.GROUP, "scope": "Namespaced", "names": names, "versions": [version]},
    }
