"""The phases of an InferenceEngine and of each engine group, and the types of its conditions:
one definition, used by the CRD schema (its enums and descriptions) and by the logic that sets
and reads them. str enums, so a value is written to and compared with status as the plain
string the API holds."""

from __future__ import annotations

import enum


class WireEnum(str, enum.Enum):
    """A str enum that formats as its value on every Python version (3.12 changed mixed-in
    enums' format): what the API holds, in status, in the schema and in messages."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Phase(WireEnum):
    """status.phase of the InferenceEngine."""

    PENDING = "Pending"  # nothing created yet
    PROGRESSING = "Progressing"  # groups or frontends starting, rolling, draining
    READY = "Ready"  # every group Ready and a frontend serving them
    DEGRADED = "Degraded"  # a group is failed or backing off; the others serve
    FAILED = "Failed"  # invalid spec, or every group failed for good
    TERMINATING = "Terminating"  # being deleted: groups stop in rank order


class GroupPhase(WireEnum):
    """status.groups[].phase of one engine group."""

    PENDING = "Pending"
    STARTING = "Starting"  # pods created, not every rank Ready
    READY = "Ready"
    FAILED = "Failed"  # a permanent cause or a restart limit: not restarted until the spec changes
    BACKING_OFF = "BackingOff"  # died; recreated at nextRestartTime once its old pods are gone
    DRAINING = "Draining"  # stopping for scale-down or delete: rank 0 drains first
    UPDATING = "Updating"  # stopping to be recreated at a new revision


class GroupStage(WireEnum):
    """status.groups[].stage: where a Starting group is, read from its pods' status. The engine's
    /health says only ok or not, so loading weights, sizing the KV cache and waiting for the
    headless ranks are one stage, Loading."""

    SCHEDULING = "Scheduling"  # a rank's pod is not bound to a node yet
    PULLING_IMAGE = "PullingImage"  # a rank's container is not started: image pull, volumes
    FETCHING_MODEL = "FetchingModel"  # a rank's model-fetch init container downloads (hf://)
    RESTARTING = "Restarting"  # a rank's container is waiting to start again (CrashLoopBackOff)
    LOADING = "Loading"  # every container runs; rank 0's /health is not ok yet
    LOADING_ADAPTERS = "LoadingAdapters"  # every rank Ready; the InferenceAdapters load first
    READY = "Ready"  # every rank Ready


# Groups in these phases are on their way somewhere: the Progressing condition lists them.
MOVING = (GroupPhase.PENDING, GroupPhase.STARTING, GroupPhase.UPDATING, GroupPhase.DRAINING)


class ConditionType(WireEnum):
    """status.conditions[].type: every condition the operator sets (status.py), in the order it
    writes them; the CRD lists the same."""

    SPEC_VALID = "SpecValid"  # the spec passed the operator's cross-field checks
    READY = "Ready"  # every desired group Ready and a frontend serving them
    SERVING = "Serving"  # frontends Ready, and the groups their discovery list gives them
    PROGRESSING = "Progressing"  # groups starting, rolling or draining
    DEGRADED = "Degraded"  # a group failed or backing off
    ENGINE_DEAD = "EngineDead"  # the last engine death and its cause


class AdapterPhase(WireEnum):
    """status.phase of an InferenceAdapter (adapter_status.py)."""

    PENDING = "Pending"  # waiting: no engine, no spec.lora, the source not mounted, no group yet
    LOADING = "Loading"  # loaded on fewer than every serving group, or not yet probed
    READY = "Ready"  # a request for it through the frontend Service succeeded
    FAILED = "Failed"  # the engine refused it for good (rank, modules, base): fix the adapter


class AdapterCondition(WireEnum):
    """status.conditions[].type of an InferenceAdapter."""

    LOADED = "Loaded"  # on every serving group of its engine
    READY = "Ready"  # a probe through the frontend Service for its name succeeded
