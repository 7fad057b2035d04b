"""What became of one fuzzed InferenceEngine on a real API server with the real operator
(tests/operator/test_op_fuzz_k8s.py): refused at apply (422 naming the field), accepted and
reported SpecValid=False naming the field, or served (SpecValid=True and every child the
operator's own render names created, owned by the resource). Anything else is a problem: a
refusal that names no field, a SpecValid that never comes, a child missing or without owner.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from shoal.operator import labels as L
from shoal.operator import render
from shoal.operator.spec import parse
from support.spec_mutations import Case, normalized

ANY_FIELD = re.compile(r"\b(spec|metadata)\.[A-Za-z]")
# Kinds the operator (or, for ReplicaSets and frontend pods, a controller of its Deployment)
# creates in an engine's namespace: (apiVersion, plural).
CHILD_KINDS = {"Pod": ("v1", "pods"), "Service": ("v1", "services"),
               "ConfigMap": ("v1", "configmaps"), "ServiceAccount": ("v1", "serviceaccounts"),
               "Deployment": ("apps/v1", "deployments"), "ReplicaSet": ("apps/v1", "replicasets"),
               "Role": ("rbac.authorization.k8s.io/v1", "roles"),
               "RoleBinding": ("rbac.authorization.k8s.io/v1", "rolebindings"),
               "Lease": ("coordination.k8s.io/v1", "leases")}
NAMESPACE_DEFAULTS = {("ServiceAccount", "default"), ("ConfigMap", "kube-root-ca.crt")}


class Outcome(str, Enum):
    REJECTED = "rejected at apply (422, field named)"
    INVALID = "SpecValid=False (field named)"
    SERVED = "served (SpecValid=True, children owned)"


@dataclass
class Result:
    case: Case
    name: str
    outcome: Outcome | None = None
    problem: str | None = None  # set: the case broke a rule (the test fails, naming it)
    message: str = ""  # the refusal's or the SpecValid condition's

    @property
    def child_refused(self) -> bool:
        """SpecValid=False from a child the API server refused (refusals.py), not validation."""
        return self.outcome is Outcome.INVALID and "the API server refused" in self.message


def names_field(case: Case, text: str) -> bool:
    """The refusal names the mutated field (or, for a drawn spec, some field)."""
    if case.field is None:
        return bool(ANY_FIELD.search(text))
    return normalized(case.field) in normalized(text)


def rejected(result: Result, status: int, body: str) -> Result:
    result.outcome, result.message = Outcome.REJECTED, body
    if status != 422 or not names_field(result.case, body):
        result.problem = f"refused with {status} without naming {result.case.field}: {body[:400]}"
    return result


def spec_valid(ie: dict) -> dict | None:
    """The SpecValid condition of the resource's current generation (None: not yet)."""
    status = ie.get("status") or {}
    if status.get("observedGeneration") != ie["metadata"].get("generation"):
        return None
    return next((c for c in status.get("conditions") or [] if c["type"] == "SpecValid"), None)


def expected_children(ie: dict, pdb_api_version: str | None) -> set[tuple[str, str]]:
    """(kind, name) of every child the operator's own render makes for the resource as stored,
    at the group count its status reports."""
    ref, spec = parse(ie)
    objs = render.singletons(ref, spec, [], pdb_api_version)
    for g in range((ie.get("status") or {}).get("replicas", 0)):
        objs += render.group_pods(ref, spec, g)
    return {(o["kind"], o["metadata"]["name"]) for o in objs}


def missing_children(ie: dict, owned: dict[tuple[str, str], str],
                     pdb_api_version: str | None) -> set[tuple[str, str]]:
    """Expected children not created yet, or created without this resource as owner; `owned`
    maps (kind, name) to the uid of its owner of kind InferenceEngine."""
    uid = ie["metadata"]["uid"]
    return {k for k in expected_children(ie, pdb_api_version) if owned.get(k) != uid}


def settle(result: Result, ie: dict, owned: dict, pdb_api_version: str | None) -> bool:
    """Classify an accepted case from the resource as stored; False while undecided."""
    cond = spec_valid(ie)
    if cond is None:
        return False
    if cond["status"] == "False":
        result.outcome, result.message = Outcome.INVALID, cond.get("message", "")
        if not names_field(result.case, cond.get("message", "")):
            result.problem = (f"SpecValid=False without naming {result.case.field}: "
                              f"{cond.get('message', '')[:400]}")
        return True
    if missing_children(ie, owned, pdb_api_version):
        return False
    result.outcome = Outcome.SERVED
    return True


def owner_uid(obj: dict, by_uid: dict[str, dict], depth: int = 0) -> str | None:
    """The uid of the InferenceEngine at the end of the object's chain of controller owners
    (a frontend pod: ReplicaSet, Deployment, InferenceEngine); None: no such chain."""
    for ref in obj["metadata"].get("ownerReferences") or []:
        if ref.get("kind") == L.KIND:
            return ref["uid"]
        parent = by_uid.get(ref.get("uid"))
        if parent is not None and depth < 5:
            return owner_uid(parent, by_uid, depth + 1)
    return None


def orphans(objects: list[dict], engines: set[str]) -> list[str]:
    """Objects in the namespace whose owner chain reaches no InferenceEngine that exists."""
    by_uid = {o["metadata"]["uid"]: o for o in objects}
    return [f"{o['kind']} {o['metadata']['name']}" for o in objects
            if (o["kind"], o["metadata"]["name"]) not in NAMESPACE_DEFAULTS
            and owner_uid(o, by_uid) not in engines]
