"""Engine death, read from pod status: which rank died first, how, and the engine's own words.

An exit the operator did not ask for is a failure, whatever the exit code (a vLLM server can
exit 0 after its EngineCore died). Pods the operator is stopping carry a deletionTimestamp and
are never counted.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from shoal.contract.termination import Cause, is_permanent, parse_termination_message
from shoal.operator import labels as L


@dataclass(frozen=True)
class Failure:
    group: int
    rank: int
    pod: str
    uid: str
    node: str
    exit_code: int | None
    signal: int | None
    reason: str
    cause: str
    permanent: bool
    message: str
    time: str
    # The engine's process that died first, when the termination message names it (Shoal's
    # supervisor in front of a stock vLLM: `APIServer`, `EngineCore_DP0`, `Worker_TP1`).
    process: str = ""

    def to_status(self) -> dict:
        d = asdict(self)
        out = {
            "group": d["group"],
            "rank": d["rank"],
            "pod": d["pod"],
            "node": d["node"],
            "exitCode": d["exit_code"],
            "signal": d["signal"],
            "reason": d["reason"],
            "cause": d["cause"],
            "permanent": d["permanent"],
            "message": d["message"],
            "time": d["time"],
            "process": d["process"],
        }
        return {k: v for k, v in out.items() if v not in (None, "")} | {"permanent": self.permanent}

    @property
    def rank_process(self) -> str:
        """`rank R`, and `(PROCESS)` when the message named it: how group messages name it."""
        return f"rank {self.rank}" + (f" ({self.process})" if self.process else "")

    @property
    def who(self) -> str:
        """`rank R pod P` and the process when known: how Events (and so the operator's log
        line of each, events.py) name the death."""
        return f"rank {self.rank} pod {self.pod}" + (f" process {self.process}"
                                                      if self.process else "")

    @property
    def key(self) -> str:
        """Identifies this death, so a failure is recorded and acted on exactly once."""
        return f"{self.uid}/{self.time}"


# How a kubelet fills `terminated.message` when FallbackToLogsOnError cannot read the log.
KUBELET_LOG_ERROR = "Error on reading termination message from logs:"


def _engine_state(pod: dict) -> dict:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if cs.get("name") == L.ENGINE_CONTAINER:
            return cs
    return {}


def failed_init(pod: dict) -> tuple[str, dict] | None:
    """The first init container that ended with an error (model-fetch, a template's own), and
    its terminated state. Engine pods never restart in place (restartPolicy Never): the pod has
    failed, and the operator restarts the group with its back-off, or not, by the cause."""
    for cs in (pod.get("status") or {}).get("initContainerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated") or {}
        if term and term.get("exitCode") not in (0, None):
            return cs.get("name") or "", term
    return None


def terminated_state(pod: dict) -> dict | None:
    """The engine container's terminated state, a failed init container's (its reason naming
    it), or a synthetic one for a pod that failed without one (evicted, or the node lost)."""
    state = (_engine_state(pod).get("state") or {}).get("terminated")
    if state:
        return state
    if (init := failed_init(pod)) is not None:
        name, term = init
        return {**term, "reason": f"{name}: {term.get('reason') or 'Error'}"}
    status = pod.get("status") or {}
    if status.get("phase") in ("Failed", "Succeeded"):
        return {"exitCode": None, "reason": status.get("reason") or status.get("phase"),
                "message": status.get("message") or "", "finishedAt": None}
    return None


def is_stopping(pod: dict) -> bool:
    return bool(pod["metadata"].get("deletionTimestamp"))


def failure_of(pod: dict) -> Failure | None:
    """The pod's failure, or None if it is alive or stopping because the operator asked."""
    if is_stopping(pod):
        return None
    term = terminated_state(pod)
    if term is None:
        return None
    meta, labels = pod["metadata"], pod["metadata"].get("labels") or {}
    code = term.get("exitCode")
    signal = term.get("signal") or (code - 128 if isinstance(code, int) and code > 128 else None)
    reason = term.get("reason") or ""
    text = term.get("message")
    if text and text.startswith(KUBELET_LOG_ERROR):
        # The kubelet's own words (it could not read the log for FallbackToLogsOnError), not
        # the engine's: classifying them would read "no such file" as a missing model.
        text = ""
    parsed = parse_termination_message(text)
    if reason.endswith("OOMKilled"):
        cause = Cause.OOM_KILLED
    elif parsed.structured or parsed.cause != Cause.UNKNOWN:
        cause = parsed.cause
    elif signal:
        cause = Cause.SIGNALED
    else:
        cause = Cause.UNEXPECTED_EXIT
    message = parsed.message or (f"container exited with code {code} ({reason}) without a "
                                 "termination message" if code is not None else reason)
    return Failure(
        group=int(labels.get(L.LABEL_GROUP, -1)),
        rank=int(labels.get(L.LABEL_RANK, -1)),
        pod=meta["name"],
        uid=meta.get("uid", ""),
        node=(pod.get("spec") or {}).get("nodeName") or "",
        exit_code=code,
        signal=signal,
        reason=reason,
        cause=cause.value,
        permanent=is_permanent(cause),
        message=message,
        time=term.get("finishedAt") or meta.get("creationTimestamp") or "",
        process=parsed.process or "",
    )


def root_cause(pods: list[dict]) -> Failure | None:
    """The first rank to die is the cause; later deaths are consequences. Ties go to the rank
    whose message is most specific (a structured cause over a bare exit), then the lower rank."""
    failures = [f for f in (failure_of(p) for p in pods) if f]
    if not failures:
        return None
    generic = {Cause.PEER_LOST.value, Cause.UNEXPECTED_EXIT.value, Cause.UNKNOWN.value,
               Cause.SIGNALED.value}
    return min(failures, key=lambda f: (f.time or "~", f.cause in generic, f.rank))
