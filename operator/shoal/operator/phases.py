"""The phases of an InferenceEngine and of each engine group: one definition, used by the CRD
schema (its enums) and by the logic that sets and reads them. str enums, so a phase is written
to and compared with status as the plain string the API holds."""

from __future__ import annotations

import enum


class _StrPhase(str, enum.Enum):
    """Formats as its value on every Python version (3.12 changed mixed-in enums' format)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Phase(_StrPhase):
    """status.phase of the InferenceEngine."""

    PENDING = "Pending"  # nothing created yet
    PROGRESSING = "Progressing"  # groups or frontends starting, rolling, draining
    READY = "Ready"  # every group Ready and a frontend serving them
    DEGRADED = "Degraded"  # a group is failed or backing off; the others serve
    FAILED = "Failed"  # invalid spec, or every group failed for good
    TERMINATING = "Terminating"  # being deleted: groups stop in rank order


class GroupPhase(_StrPhase):
    """status.groups[].phase of one engine group."""

    PENDING = "Pending"
    STARTING = "Starting"  # pods created, not every rank Ready
    READY = "Ready"
    FAILED = "Failed"  # a permanent cause or a restart limit: not restarted until the spec changes
    BACKING_OFF = "BackingOff"  # died; recreated at nextRestartTime once its old pods are gone
    DRAINING = "Draining"  # stopping for scale-down or delete: rank 0 drains first
    UPDATING = "Updating"  # stopping to be recreated at a new revision


class GroupStage(_StrPhase):
    """status.groups[].stage: where a Starting group is, read from its pods' status. The engine's
    /health says only ok or not, so loading weights, sizing the KV cache and waiting for the
    headless ranks are one stage, Loading."""

    SCHEDULING = "Scheduling"  # a rank's pod is not bound to a node yet
    PULLING_IMAGE = "PullingImage"  # a rank's container is not started: image pull, volumes
    RESTARTING = "Restarting"  # a rank's container is waiting to start again (CrashLoopBackOff)
    LOADING = "Loading"  # every container runs; rank 0's /health is not ok yet
    READY = "Ready"  # every rank Ready


# Groups in these phases are on their way somewhere: the Progressing condition lists them.
MOVING = (GroupPhase.PENDING, GroupPhase.STARTING, GroupPhase.UPDATING, GroupPhase.DRAINING)
