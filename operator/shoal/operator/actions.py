"""What a planned pass asks the API server for: small frozen values, compared whole in the
table-driven tests of `plan.py` and carried out in order by `apply.py`.

The order of a plan's actions is the order of the writes: the discovery file is rewritten
without a group before its rank 0 is asked to stop, and the singletons a frontend mounts exist
before the Deployment that creates it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ApplyChildren:
    """Create or patch the singletons (ServiceAccount, Role, RoleBinding, discovery ConfigMap,
    headless Service, frontend Deployment and Service, PDB) where their rendered hash changed;
    `serving` is the discovery file's group list if it has to be created."""

    serving: tuple[int, ...]


@dataclass(frozen=True)
class WriteDiscovery:
    """The discovery ConfigMap lists exactly these groups' rank 0 (written when it changed)."""

    groups: tuple[int, ...]


@dataclass(frozen=True)
class CreatePods:
    """Create these ranks of group `group` at the spec's current revision."""

    group: int
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class DeletePod:
    """Delete one engine pod; `grace` None is the pod's own terminationGracePeriodSeconds (a
    drain), 0 removes the object at once. `uid` is a precondition: never a same-name successor."""

    pod: str
    uid: str | None
    grace: int | None


@dataclass(frozen=True)
class EmitEvent:
    """A core/v1 Event on the InferenceEngine (one per fact)."""

    type: str  # Normal | Warning
    reason: str
    message: str


Action = ApplyChildren | WriteDiscovery | CreatePods | DeletePod | EmitEvent
