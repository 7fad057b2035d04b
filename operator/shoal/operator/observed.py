"""What a pass observed (`Observed`), what earlier passes left in status (`Memory`), and what it
carries between its steps: pure helpers over pod dicts and the per-pass planning state (the
actions decided so far). No API calls here."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field

from shoal.contract.model_fetch import FETCH_CONTAINER
from shoal.operator import labels as L
from shoal.operator.actions import Action, EmitEvent
from shoal.operator.failures import Failure, is_stopping
from shoal.operator.fetch_progress import fetching
from shoal.operator.node_loss import NodeHealth, on_lost_node
from shoal.operator.phases import GroupStage
from shoal.operator.spec import EngineRef, EngineSpec


def iso(t: dt.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def iso_not_before(t: dt.datetime) -> str:
    """`t` rounded up to the API's 1 s resolution: a deadline stored this way is never early."""
    whole = t.replace(microsecond=0)
    return iso(whole if whole == t else whole + dt.timedelta(seconds=1))


def parse_time(s: str | None) -> dt.datetime | None:
    if not s:
        return None
    return dt.datetime.strptime(s, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc)


def pod_ready(pod: dict) -> bool:
    if is_stopping(pod) or (pod.get("status") or {}).get("phase") != "Running":
        return False
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


def frontend_urls(pods: list[dict]) -> list[str]:
    """The base URLs of the Ready ones of an engine's frontend pods (each pod's own address,
    not the Service's: a check that every frontend saw a change asks each one)."""
    out = []
    for p in pods:
        ip = (p.get("status") or {}).get("podIP")
        if ip and pod_ready(p):
            out.append(f"http://{f'[{ip}]' if ':' in ip else ip}:{L.HTTP_PORT}")
    return out


def marked_not_ready_at(pod: dict) -> dt.datetime | None:
    """When the node controller marked this running pod not Ready, or None when it was not.

    A node that missed its heartbeats for the node monitor's grace period (40 s; also every node
    after an API server outage that long) has its pods' Ready condition set False by the node
    controller, which leaves the containers' own `ready` as their kubelet last reported it. The
    pod's readiness then says nothing about the engine: its kubelet re-reports it within
    seconds of the node answering again."""
    status = pod.get("status") or {}
    if is_stopping(pod) or status.get("phase") != "Running":
        return None
    cond = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    containers = status.get("containerStatuses") or []
    if (cond is None or cond.get("status") != "False" or not containers
            or not all(c.get("ready") and (c.get("state") or {}).get("running") is not None
                       for c in containers)):
        return None
    return parse_time(cond.get("lastTransitionTime"))


@dataclass(frozen=True)
class Observed:
    """What this pass read: which resource (its identity names every child), whether it is
    being deleted and its generation, its engine pods by group and rank, and the last in-flight
    count of each draining rank 0 (drain_probe.py)."""

    ref: EngineRef
    pods: Mapping[int, Mapping[int, dict]] = field(default_factory=dict)
    # draining group -> rank 0's requests in flight
    in_flight: Mapping[int, int] = field(default_factory=dict)
    # group -> rank -> the tail of its running model-fetch container's log (fetch_progress.py)
    fetch_logs: Mapping[int, Mapping[int, str]] = field(default_factory=dict)
    deleting: bool = False
    generation: int = 0
    # spec.autoscaling only (autoscale.py): this pass's scrape of each ready group's rank 0
    # (None: no scrape this pass; a group's None: it did not answer), the wake Lease's
    # spec.renewTime as written (read only at zero), and the HPAs aimed at the resource
    # (autoscale_hpa.HPAs; None: not listed)
    samples: Mapping | None = None
    wake: str | None = None
    hpas: object | None = None
    # group -> the InferenceAdapters its rank 0 has not answered for yet (adapter_pass.py): a
    # group that was not Ready stays Starting (LoadingAdapters) until each is loaded or refused
    adapters_pending: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    # the Ready condition of each node our engine pods are on (node_loss.py); a node missing
    # here is one the API does not have (or has not said anything about)
    nodes: Mapping[str, NodeHealth] = field(default_factory=dict)


@dataclass(frozen=True)
class Memory:
    """What earlier passes left in status: per group its restarts, backoff deadline, the death
    already handled; the last failure and the restart total. A restarted operator reads the same."""

    groups: Mapping[int, dict] = field(default_factory=dict)
    last_failure: dict | None = None
    restart_count: int = 0
    autoscaling: dict | None = None  # status.autoscaling: the autoscaler's count and windows

    @classmethod
    def of(cls, status: dict) -> Memory:
        return cls(
            groups={int(g["index"]): dict(g) for g in status.get("groups") or []},
            last_failure=status.get("lastFailure"),
            restart_count=int(status.get("restartCount", 0)),
            autoscaling=status.get("autoscaling"),
        )


@dataclass
class PassState:
    """One pass's planning state inside `plan()`: its inputs, and what it decided so far (the
    actions in order, the earliest next look). Mutable on purpose, and never seen outside."""

    ref: EngineRef
    spec: EngineSpec
    now: dt.datetime
    last_failure: dict | None
    restart_count: int
    deleting: bool = False
    serving: set = field(default_factory=set)  # groups in the discovery file as of now
    requeue_after: float | None = None
    created: dict = field(default_factory=dict)  # group -> rank -> pod created in this pass
    actions: list[Action] = field(default_factory=list)
    in_flight: dict = field(default_factory=dict)  # group -> rank 0's requests in flight (draining)
    drain_probes: dict = field(default_factory=dict)  # group -> rank 0's /metrics URL to read
    fetch_logs: Mapping = field(default_factory=dict)  # group -> rank -> model-fetch log tail
    adapters_pending: Mapping = field(default_factory=dict)  # group -> adapters not answered yet
    nodes: Mapping = field(default_factory=dict)  # node -> NodeHealth (node_loss.py)
    forced: set = field(default_factory=set)  # pods deleted with grace 0 in this pass (uids)

    def act(self, action: Action) -> None:
        self.actions.append(action)

    def event(self, type_: str, reason: str, message: str) -> None:
        self.actions.append(EmitEvent(type_, reason, message))

    def lost(self, pod: dict) -> bool:
        """The pod is on a node lost by now (restartPolicy.nodeLostSeconds): only a grace-0
        delete removes it."""
        return on_lost_node(self.nodes, self.spec.restart.node_lost_seconds, pod, self.now)

    def requeue(self, seconds: float) -> None:
        seconds = max(seconds, 0.5)
        if self.requeue_after is not None:
            seconds = min(self.requeue_after, seconds)
        self.requeue_after = seconds


def owned_by(pod: dict, uid: str | None) -> bool:
    return any(o.get("uid") == uid for o in pod["metadata"].get("ownerReferences") or [])


def revision_of(pods: dict[int, dict]) -> str | None:
    revs = {p["metadata"]["labels"].get(L.LABEL_REVISION) for p in pods.values()}
    return revs.pop() if len(revs) == 1 else (None if not revs else "mixed")


def metrics_url(pod: dict) -> str | None:
    ip = (pod.get("status") or {}).get("podIP")
    return f"http://{ip}:{L.HTTP_PORT}/metrics" if ip else None


def ranks_status(pods: dict[int, dict]) -> list[dict]:
    return [
        {
            "rank": r,
            "pod": p["metadata"]["name"],
            "node": (p.get("spec") or {}).get("nodeName") or "",
            "phase": (p.get("status") or {}).get("phase") or "Pending",
            "ready": pod_ready(p),
        }
        for r, p in sorted(pods.items())
    ]


def vanished(st: PassState, g: int, mem: dict, pods: dict[int, dict], nodes: int) -> Failure:
    missing = sorted(set(range(nodes)) - set(pods))
    any_pod = next(iter(pods.values()))
    return Failure(
        group=g,
        rank=missing[0],
        pod=L.pod_name(st.ref.name, g, missing[0]),
        uid=f"missing-{any_pod['metadata'].get('uid')}",
        node="",
        exit_code=None,
        signal=None,
        reason="Deleted",
        cause="unexpected_exit",
        permanent=False,
        message=(f"pod of rank {missing[0]} disappeared while the group was ready "
                 "(deleted or evicted by someone other than the operator)"),
        time=iso(st.now),
    )


def no_empty_strings(obj):
    """Drop "" values: the 1.20 test server decodes them in custom resources as null and then
    rejects them as not strings; an absent optional field says the same."""
    if isinstance(obj, dict):
        return {k: no_empty_strings(v) for k, v in obj.items() if v != ""}
    if isinstance(obj, list):
        return [no_empty_strings(v) for v in obj]
    return obj


def status_differs(old: dict, new: dict) -> bool:
    """Status changed, ignoring keys that only the operator's clock moves."""
    return {k: old.get(k) for k in new} != new


# How long past engine.startupTimeoutSeconds a group may stay not Ready before it is stalled:
# the startup probe counts from the container's start; scheduling and the image pull come first.
STALL_MARGIN_SECONDS = 120


# Waiting reasons that say only that the container has not started yet.
QUIET_WAITS = ("ContainerCreating", "PodInitializing")


def waiting_reason(pod: dict) -> str:
    """Why a pod is not running yet, as the kubelet or scheduler said it (ImagePullBackOff,
    CrashLoopBackOff, Unschedulable, a missing Secret, ...), with its message; "" when nothing
    is said. An init container's (the model-fetch) comes first, named: it is what blocks."""
    status = pod.get("status") or {}
    for cs in status.get("initContainerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") and waiting["reason"] not in QUIET_WAITS:
            text = f"{cs.get('name')}: {waiting['reason']}: {waiting.get('message', '')[:160]}"
            if cs.get("name") == FETCH_CONTAINER and "secret" in waiting.get("message", ""):
                text += " (spec.modelAuth.secretName)"
            return text.strip(": ")
    for cs in status.get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") and waiting["reason"] not in QUIET_WAITS:
            return f"{waiting['reason']}: {waiting.get('message', '')[:160]}".strip(": ")
    for c in status.get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason"):
            return f"{c['reason']}: {c.get('message', '')[:160]}".strip(": ")
    return ""


def stalled(st: PassState, g: int, pods: dict[int, dict], startup_timeout: int) -> Failure | None:
    """A group whose ranks are not all Ready long after it was created (stuck Pending, an image
    that never pulls, a headless rank that never joins): cause `stalled`, restarted like a death.
    Plans a pass at the deadline when it has not come yet."""
    created = [parse_time(p["metadata"].get("creationTimestamp")) for p in pods.values()]
    created = [c for c in created if c]
    if not created:
        return None
    limit = startup_timeout + STALL_MARGIN_SECONDS
    deadline = min(created) + dt.timedelta(seconds=limit)
    if st.now < deadline:
        st.requeue((deadline - st.now).total_seconds())
        return None
    rank, pod = next((r, p) for r, p in sorted(pods.items()) if not pod_ready(p))
    why = waiting_reason(pod) or f"pod phase {(pod.get('status') or {}).get('phase') or 'Pending'}"
    return Failure(
        group=g,
        rank=rank,
        pod=pod["metadata"]["name"],
        uid=f"stalled-{pod['metadata'].get('uid')}",
        node=(pod.get("spec") or {}).get("nodeName") or "",
        exit_code=None,
        signal=None,
        reason="Stalled",
        cause="stalled",
        permanent=False,
        message=(f"rank {rank} not Ready {int((st.now - min(created)).total_seconds())}s after "
                 f"its group was created (limit {limit}s: engine.startupTimeoutSeconds "
                 f"+ {STALL_MARGIN_SECONDS}s); {why}"),
        time=iso(deadline),
    )


IMAGE_WAITS = ("ContainerCreating", "PodInitializing", "ErrImagePull", "ImagePullBackOff")


def startup_stage(pods: dict[int, dict]) -> GroupStage:
    """The earliest stage any rank of a group is in (a group is as far as its slowest rank)."""
    stages = []
    for p in pods.values():
        status = p.get("status") or {}
        scheduled = (p.get("spec") or {}).get("nodeName") or any(
            c.get("type") == "PodScheduled" and c.get("status") == "True"
            for c in status.get("conditions") or []
        )
        containers = status.get("containerStatuses") or []
        waits = [(cs.get("state") or {}).get("waiting") for cs in containers]
        if not scheduled:
            stages.append(GroupStage.SCHEDULING)
        elif fetching(p):
            stages.append(GroupStage.FETCHING_MODEL)
        elif not containers or any(w and w.get("reason") in IMAGE_WAITS for w in waits):
            stages.append(GroupStage.PULLING_IMAGE)
        elif any(waits):
            stages.append(GroupStage.RESTARTING)
        elif not pod_ready(p):
            stages.append(GroupStage.LOADING)
        else:
            stages.append(GroupStage.READY)
    order = list(GroupStage)
    return min(stages, key=order.index, default=GroupStage.SCHEDULING)
