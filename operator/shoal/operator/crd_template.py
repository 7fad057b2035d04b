"""The schema of `spec.engine.template` and `spec.frontend.template`: a pod template (metadata +
spec) merged over the pods the operator renders (template.py). Every field template.py accepts
is typed and described here (LeaderWorkerSet's style); the Kubernetes types inside them
(affinity, a container, a volume) are kept as written and checked by the API server when the
operator creates the pod.

Where a field is refused: a wrong type or value (a toleration's `operator: Sometimes`, a
container without a name) by this schema at apply; a field the operator owns (a container's
`command`, `restartPolicy`, ...) by the operator, as SpecValid=False naming the field and why: a
1.20 API server has no CEL rules to say why, and the unknown fields are kept
(`x-kubernetes-preserve-unknown-fields`), never pruned, so the operator sees every one.
"""

from __future__ import annotations

from shoal.operator import template as T
from shoal.operator.openapi import obj, opaque, typed

KEEP = {"x-kubernetes-preserve-unknown-fields": True}


# A label's value and a container's or volume's name, as a pod checks them (1.20 and every later
# release): refused at apply instead of by the pod's creation (found by fuzzing).
LABEL_VALUE = {"type": "string", "maxLength": 63,
               "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"}
DNS_LABEL = {"maxLength": 63, "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"}


def _strings(description: str, values: dict | None = None) -> dict:
    return typed("object", description, additionalProperties=values or {"type": "string"})


def _named(what: str, example: str, dns_label: bool = False) -> dict:
    item = obj(f"One {what}, as in a Pod.",
               {"name": typed("string", f"name of the {what}. Example: `{example}`.",
                              minLength=1, **(DNS_LABEL if dns_label else {}))},
               required=["name"], **KEEP)
    return item


def _tolerations() -> dict:
    item = obj(
        "One toleration, as in a Pod.",
        {
            "key": typed("string", "key is the taint key it tolerates; empty with `Exists` "
                         "tolerates every taint. Example: `nvidia.com/gpu`."),
            "operator": typed("string", "operator: `Exists` (any value) or `Equal`. Example: "
                              "`Exists`. Default: `Equal`.", enum=["Exists", "Equal"]),
            "value": typed("string", "value the taint must have with `Equal`. Example: "
                           "`present`.", maxLength=63, pattern=LABEL_VALUE["pattern"]),
            "effect": typed("string", "effect it tolerates; empty tolerates all. Example: "
                            "`NoSchedule`.", enum=["NoSchedule", "PreferNoSchedule",
                                                   "NoExecute"]),
            "tolerationSeconds": typed("integer", "tolerationSeconds: how long a `NoExecute` "
                                       "taint is tolerated. Example: `300`.", format="int64"),
        },
    )
    return typed("array", "tolerations are added to the pods' tolerations (GPU pools are "
                 "usually tainted). Example: `[{key: nvidia.com/gpu, operator: Exists, effect: "
                 "NoSchedule}]`. Default: none.", items=item)


def _spread() -> dict:
    item = obj(
        "One topology spread constraint, as in a Pod (newer fields such as `minDomains` and "
        "`matchLabelKeys` are kept as written).",
        {
            "maxSkew": typed("integer", "maxSkew is the most the pod counts of two domains may "
                             "differ. Example: `1`.", minimum=1, format="int32"),
            "topologyKey": typed("string", "topologyKey is the node label of a domain. "
                                 "Example: `topology.kubernetes.io/zone`.", minLength=1),
            "whenUnsatisfiable": typed("string", "whenUnsatisfiable: `DoNotSchedule` or "
                                       "`ScheduleAnyway`. Example: `ScheduleAnyway`.",
                                       enum=["DoNotSchedule", "ScheduleAnyway"]),
            "labelSelector": opaque("labelSelector picks the pods counted, e.g. "
                                    "`{matchLabels: {shoal.dev/engine: llm, "
                                    "shoal.dev/rank: '0'}}`."),
        },
        required=["maxSkew", "topologyKey", "whenUnsatisfiable"], **KEEP,
    )
    return typed("array", "topologySpreadConstraints are added to the pods', e.g. to spread "
                 "groups over zones. Example: `[{maxSkew: 1, topologyKey: "
                 "topology.kubernetes.io/zone, whenUnsatisfiable: ScheduleAnyway, "
                 "labelSelector: {matchLabels: {shoal.dev/engine: llm}}}]`. Default: none.",
                 items=item)


def _owned(reasons: dict[str, str]) -> str:
    return "; ".join(f"`{k}` ({why})" for k, why in reasons.items())


def _containers(main: str) -> dict:
    fields = ", ".join(f"`{f}`" for f in T.CONTAINER_FIELDS[1:])
    return typed(
        "array",
        f"containers merge by name: the one named `{main}` is the operator's container, of "
        f"which a template may set {fields} (added to the operator's; a variable or mount "
        f"path the operator sets is refused); its other fields are the operator's, and "
        f"setting one is SpecValid=False: {_owned(T.OWNED_CONTAINER)}. Any other name is a "
        f"sidecar container, added as written. Example: `[{{name: {main}, env: [{{name: "
        "HF_HOME, value: /cache}], volumeMounts: [{name: cache, mountPath: /cache}]}, {name: "
        "log-shipper, image: fluent/fluent-bit:3.2}]`. Default: none.",
        items=_named("container", main, dns_label=True),
    )


def _spec(main: str, owned_pod: dict[str, str]) -> dict:
    owned = {**T.OWNED_POD, **owned_pod}
    fields = {
        "nodeSelector": _strings("nodeSelector: node labels the pods must land on (merged "
                                 "with the operator's, which sets none). Example: "
                                 "`{cloud.google.com/gke-accelerator: nvidia-h100-80gb}`. "
                                 "Default: none.", LABEL_VALUE),
        "tolerations": _tolerations(),
        "affinity": opaque("affinity, as in a Pod: `nodeAffinity` and `podAffinity` as "
                           "written; `podAntiAffinity` terms are added to the operator's own "
                           "(the ranks of a multi-node group repel each other per node), "
                           "never replace them. Example: `{nodeAffinity: "
                           "{requiredDuringSchedulingIgnoredDuringExecution: {nodeSelectorTerms: "
                           "[{matchExpressions: [{key: gpu, operator: In, values: [h100]}]}]}}}`."
                           " Default: none beyond the operator's."),
        "topologySpreadConstraints": _spread(),
        "priorityClassName": typed("string", "priorityClassName of the pods. Example: "
                                   "`inference-high`. Default: none (the cluster's default)."),
        "runtimeClassName": typed("string", "runtimeClassName of the pods. Example: `nvidia`. "
                                  "Default: none (the node's default runtime)."),
        "schedulerName": typed("string", "schedulerName: the scheduler that places the pods "
                               "(a gang scheduler, say). Example: `volcano`. Default: the "
                               "cluster's default scheduler."),
        "imagePullSecrets": typed("array", "imagePullSecrets are added to the pods', merged by "
                                  "name. Example: `[{name: registry-creds}]`. Default: none.",
                                  items=_named("image pull secret", "registry-creds")),
        "serviceAccountName": typed("string", "serviceAccountName the pods run as (engine pods "
                                    "only: a frontend's is the operator's). Example: "
                                    "`inference`. Default: the namespace's `default`."),
        "securityContext": opaque("securityContext of the pods, as in a Pod. Example: "
                                  "`{runAsNonRoot: true, fsGroup: 10001}`. Default: none."),
        "volumes": typed("array", "volumes are added to the pods', merged by name (a name the "
                         "operator uses, such as `model`, `model-cache`, `shoal-supervisor` "
                         "or `dshm`, is refused). Example: `[{name: cache, emptyDir: {}}]`. "
                         "Default: none.",
                         items=_named("volume", "cache", dns_label=True)),
        "initContainers": typed("array", "initContainers run before the pod's containers, as "
                                "written, after the operator's own (`install-supervisor` "
                                "for runtime VLLM, `model-fetch` for an hf:// model, "
                                "`model-image` for oci://; a template that names them is "
                                "refused). Example: `[{name: warm, image: "
                                "busybox:1.36, command: [sh, -c, 'cat /models/x/*.safetensors "
                                "> /dev/null']}]`. Default: none.",
                                items=_named("init container", "warm", dns_label=True)),
        "containers": _containers(main),
    }
    return obj(
        f"spec holds the pod fields a template may set, merged over the operator's pod. The "
        f"pod fields the operator owns are refused with SpecValid=False naming them: "
        f"{_owned(owned)}; any other field not listed here is refused the same way (not "
        "supported in a template yet). Example: `{nodeSelector: {pool: gpu}, tolerations: "
        "[{key: nvidia.com/gpu, operator: Exists}]}`.",
        fields, **KEEP,
    )


def template_schema(who: str, main: str, owned_pod: dict[str, str]) -> dict:
    """The schema of one template: `who` names the pods, `main` their operator container."""
    meta = obj(
        f"metadata of every {who} pod: labels and annotations added to the operator's (a key "
        f"the operator sets, or any `{T.RESERVED_PREFIX}` key, is refused with SpecValid=False; "
        "name and namespace are the operator's). Example: `{labels: {team: search}, "
        "annotations: {prometheus.io/scrape: 'true'}}`.",
        {"labels": _strings("labels added to every pod. Example: `{team: search}`. Default: "
                            "none.", LABEL_VALUE),
         "annotations": _strings("annotations added to every pod. Example: "
                                 "`{cluster-autoscaler.kubernetes.io/safe-to-evict: 'false'}`. "
                                 "Default: none.")},
        **KEEP,
    )
    return obj(
        f"template is a pod template (metadata + spec) merged over every {who} pod the "
        "operator renders, as a strategic merge patch does (maps merge; containers, volumes, "
        "env and image pull secrets by name; mounts by path; tolerations, spread constraints "
        "and affinity terms are added). What the operator owns cannot be overridden; nothing "
        "written here is dropped without SpecValid=False saying so. Example: `{metadata: "
        "{labels: {team: search}}, spec: {nodeSelector: {pool: gpu}, tolerations: [{key: "
        "nvidia.com/gpu, operator: Exists, effect: NoSchedule}]}}`. Default: none.",
        {"metadata": meta, "spec": _spec(main, owned_pod)},
        **KEEP,
    )
