"""A user's pod template (`spec.engine.template`, `spec.frontend.template`) merged over the pod
the operator renders, as a strategic merge patch does: maps merge, containers, init containers
(the operator's own, such as `install-supervisor` and `model-fetch`, run first),
volumes, image pull secrets and env merge by name, volume mounts by mount path; tolerations,
topology spread constraints and affinity terms are added to the operator's own (a multi-node
group keeps its one-rank-per-node anti-affinity).

Two pure functions: `merge` (total: where both set one thing, the operator's value stays) and
`problems`, which names every field the user may not set and why, so that nothing written in a
template is dropped without a SpecValid=False saying so. Which fields a template may set is one
table (POD_FIELDS, CONTAINER_FIELDS); owned ones carry their reason (the CRD text quotes them).
"""

from __future__ import annotations

import copy

RESERVED_PREFIX = "shoal.dev/"  # the operator's labels and annotations

# Pod spec fields a template may set (the CRD documents each).
POD_FIELDS = ("nodeSelector", "tolerations", "affinity", "topologySpreadConstraints",
              "priorityClassName", "runtimeClassName", "schedulerName", "imagePullSecrets",
              "serviceAccountName", "securityContext", "volumes", "initContainers", "containers")
# Pod spec fields the operator owns, and why.
OWNED_POD = {
    "hostname": "rank pods are named and found by the operator (NAME-gG-rR.NAME-ranks)",
    "subdomain": "rank pods are named and found by the operator (NAME-gG-rR.NAME-ranks)",
    "restartPolicy": "the operator restarts whole groups (spec.restartPolicy); a kubelet "
                     "restart of one rank would hide its death",
    "terminationGracePeriodSeconds": "it is spec.shutdown.timeoutSeconds plus a margin, so a "
                                     "drain is never cut short",
}
FRONTEND_OWNED_POD = {
    "serviceAccountName": "the frontends' ServiceAccount NAME-frontend is the one allowed to "
                          "read the discovery ConfigMap",
    "automountServiceAccountToken": "the frontends watch the discovery ConfigMap through the "
                                    "API with their ServiceAccount's token",
}
# Fields of the operator's own container (`engine`, `frontend`) a template may set.
CONTAINER_FIELDS = ("name", "env", "envFrom", "volumeMounts", "volumeDevices", "securityContext")
OWNED_CONTAINER = {
    "image": "set spec.image (engine) or spec.frontend.image",
    "imagePullPolicy": "set spec.imagePullPolicy",
    "command": "spec.runtime picks it: Shoal's image keeps its entrypoint (tini) as PID 1 so "
               "signals and exit codes reach the engine and the kubelet; a stock vLLM runs "
               "under Shoal's supervisor, which writes its termination message",
    "args": "the command line is the rank's place in its group; add flags with "
            "spec.engine.extraArgs",
    "ports": "the ports are the Services' and the probes' (8000, masterPort)",
    "startupProbe": "the probes are what Ready means (spec.engine.startupTimeoutSeconds sets "
                    "the start-up budget)",
    "readinessProbe": "the probes are what Ready means",
    "livenessProbe": "the probes are what Ready means",
    "terminationMessagePath": "the operator reads a dying engine's cause from it",
    "terminationMessagePolicy": "the operator reads a dying engine's cause from it",
    "resources": "set spec.engine.resources or spec.frontend.resources",
    "lifecycle": "the drain is the operator's (SIGTERM, then spec.shutdown.timeoutSeconds); a "
                 "preStop hook would use up its time",
}
# Lists merged item by item on this key; lists the template adds to; any other list that both
# sides set (a command line) stays the operator's.
MERGE_KEYS = {"containers": "name", "initContainers": "name", "volumes": "name",
              "imagePullSecrets": "name", "env": "name", "volumeMounts": "mountPath",
              "ports": "containerPort"}
ADDED = {"tolerations", "topologySpreadConstraints", "envFrom", "volumeDevices",
         "requiredDuringSchedulingIgnoredDuringExecution",
         "preferredDuringSchedulingIgnoredDuringExecution"}


def merge(base: dict, template: dict | None) -> dict:
    """The pod (`{metadata, spec}`) with the template merged in; the operator's values stay
    where both set one thing (`problems` reports every such place)."""
    if not template:
        return base
    return _merge(base, copy.deepcopy(template))


def _merge(base, user, key: str = ""):
    if isinstance(base, dict) and isinstance(user, dict):
        out = {k: _merge(v, user[k], k) if k in user else v for k, v in base.items()}
        return out | {k: v for k, v in user.items() if k not in base}
    if isinstance(base, list) and isinstance(user, list):
        on = MERGE_KEYS.get(key)
        if not on:
            return base + user if key in ADDED else base
        mine = [item.get(on) for item in base]
        if key == "containers":  # the operator's container takes the template's fields
            base = [_merge(item, _by(user, on, item.get(on)), on) for item in base]
        return base + [i for i in user if not isinstance(i, dict) or i.get(on) not in mine]
    return base


def _by(items: list, key: str, value) -> dict:
    return next((i for i in items if isinstance(i, dict) and i.get(key) == value), {})


def problems(where: str, template: dict | None, base: dict, main: str,
             owned_pod: dict[str, str], owned_inits: dict[str, str] | None = None) -> list[str]:
    """Every field of `template` that the merge over `base` could not keep, named by its path
    under `where` (e.g. `spec.engine.template`), with the reason; [] when all of it is kept.
    `main` is the operator's container; `owned_pod` the pod fields owned beyond OWNED_POD;
    `owned_inits` says why each of the operator's init containers is its own."""
    if not template:
        return []
    out = _metadata_problems(where, template.get("metadata") or {}, base["metadata"])
    out += [f"{where}.{k} is not part of a pod template (metadata, spec)"
            for k in template if k not in ("metadata", "spec")]
    spec, at = template.get("spec") or {}, f"{where}.spec"
    owned = {**OWNED_POD, **owned_pod}
    for k in spec:
        if k in owned:
            out.append(f"{at}.{k} is set by the operator: {owned[k]}")
        elif k not in POD_FIELDS:
            out.append(f"{at}.{k} is not supported in a template (supported: "
                       f"{', '.join(POD_FIELDS)})")
    out += _named_clashes(f"{at}.volumes", spec.get("volumes"), base["spec"].get("volumes"),
                          "name", "a volume of the operator's")
    return out + _container_problems(at, spec, base["spec"], main, owned_inits or {})


def _metadata_problems(where: str, meta: dict, base: dict) -> list[str]:
    out = [f"{where}.metadata.{k} is set by the operator: only labels and annotations may be "
           "added" for k in meta if k not in ("labels", "annotations")]
    for part in ("labels", "annotations"):
        theirs = base.get(part) or {}
        for k in meta.get(part) or {}:
            if k in theirs or k.startswith(RESERVED_PREFIX):
                out.append(f"{where}.metadata.{part}[{k}] is set by the operator (the "
                           f"{RESERVED_PREFIX} keys are its own)")
    return out


def _container_problems(at: str, spec: dict, base: dict, main: str,
                        owned_inits: dict[str, str]) -> list[str]:
    out = []
    names = [c.get("name") for c in (spec.get("initContainers") or []) + (spec.get("containers")
                                                                            or [])]
    for dup in sorted({n for n in names if n and names.count(n) > 1}):
        out.append(f"{at}: container name {dup!r} is used twice")
    ours = next(c for c in base["containers"] if c["name"] == main)
    ports = {p["containerPort"] for p in ours.get("ports") or []}
    inits = {c["name"] for c in base.get("initContainers") or []}
    for part in ("initContainers", "containers"):
        for i, c in enumerate(spec.get(part) or []):
            if not c.get("name"):
                out.append(f"{at}.{part}[{i}] needs a name (containers merge by name)")
            elif c["name"] in inits:
                why = owned_inits.get(c["name"], "it is one of the operator's init containers")
                out.append(f"{at}.{part}[{c['name']}] is set by the operator: {why}")
            elif part == "containers" and c["name"] == main:
                out += _main_problems(f"{at}.containers[{main}]", c, ours)
            else:
                out += [f"{at}.{part}[{c['name']}].ports: {p.get('containerPort')} is a port "
                        f"of the {main} container" for p in c.get("ports") or []
                        if p.get("containerPort") in ports]
                if part == "initContainers" and c["name"] == main:
                    out.append(f"{at}.initContainers[{main}]: {main!r} is the operator's "
                               "container")
    return out


def _main_problems(at: str, c: dict, ours: dict) -> list[str]:
    out = []
    for k in c:
        if k in OWNED_CONTAINER:
            out.append(f"{at}.{k} is set by the operator: {OWNED_CONTAINER[k]}")
        elif k not in CONTAINER_FIELDS:
            out.append(f"{at}.{k} is not supported in a template (supported: "
                       f"{', '.join(CONTAINER_FIELDS[1:])})")
    out += _named_clashes(f"{at}.env", c.get("env"), ours.get("env"), "name",
                          "a variable the operator (or spec.engine.env) sets")
    return out + _named_clashes(f"{at}.volumeMounts", c.get("volumeMounts"),
                                ours.get("volumeMounts"), "mountPath", "a mount of the operator's")


def _named_clashes(at: str, items, base, key: str, what: str) -> list[str]:
    """Items the merge would drop or overwrite: a key the operator's list has, or one given
    twice."""
    mine, seen, out = {i.get(key) for i in base or []}, set(), []
    for item in items or []:
        value = item.get(key) if isinstance(item, dict) else None
        if value is None:
            out.append(f"{at}: an item has no {key}")
        elif value in mine:
            out.append(f"{at}[{value}] is {what}")
        elif value in seen:
            out.append(f"{at}[{value}] is given twice")
        seen.add(value)
    return out


def with_removals(have: dict, want: dict) -> dict:
    """`want` (a Deployment's pod template) as a JSON merge patch over `have`: a merge patch
    keeps what it leaves out, so the fields a template may set (and labels, annotations) that
    `have` has and `want` has not are sent as null, and a field taken out of the template
    leaves the Deployment too. The server's defaults among them come back by themselves."""
    out = copy.deepcopy(want)
    for part in ("labels", "annotations"):
        gone = set((have.get("metadata") or {}).get(part) or {}) - set(want["metadata"].get(part)
                                                                       or {})
        if gone:
            out["metadata"].setdefault(part, {}).update(dict.fromkeys(gone))
    spec = have.get("spec") or {}
    out["spec"].update({k: None for k in POD_FIELDS if k in spec and k not in want["spec"]})
    return out
