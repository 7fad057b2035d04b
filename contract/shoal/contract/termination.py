"""The termination message: what a dying engine process tells the operator, and how it is read.

Kubernetes copies the file at a container's `terminationMessagePath` (default
`/dev/termination-log`) into `status.containerStatuses[].state.terminated.message` when the
container stops, capped at 4096 bytes. The engine writes one JSON object there on every failure
path; the operator reads it back from pod status and files it as the resource's `lastFailure`.

This module is shared by both sides and imports nothing beyond the standard library (no torch,
no kubernetes), so the engine and the operator agree on exactly one format.

Format (one JSON object, keys in this order, all but `cause` and `message` optional)::

    {"v": 1, "cause": "out_of_memory", "rank": 1, "message": "CUDA out of memory ...",
     "exitCode": 1, "pid": 42, "time": "2026-11-29T15:00:00Z", "process": "EngineCore_DP0"}

`process` (appended in issue 25) names the process of the engine that died first when the
writer knows it (the supervisor in front of a stock vLLM: `APIServer`, `EngineCore_DP0`,
`Worker_TP1`); `pid` is then that process's pid.

Stock images (plain `vllm serve`) write nothing, and with `FallbackToLogsOnError` Kubernetes
puts the log tail there instead: `parse_termination_message` accepts any text and classifies
what it can, so the operator never fails on a message it did not expect.
"""

from __future__ import annotations

import datetime as _dt
import enum
import json
import os
import re
from dataclasses import dataclass

from shoal.contract import env

# Kubernetes truncates the termination message to 4096 bytes (and to 12 KiB over all containers).
MAX_MESSAGE_BYTES = 4096
DEFAULT_PATH = "/dev/termination-log"
FORMAT_VERSION = 1


class Cause(str, enum.Enum):
    """Why an engine process stopped. Values are the strings written to the wire and to status."""

    ENGINE_ERROR = "engine_error"  # an exception in the EngineCore or a worker's step
    COLLECTIVE_TIMEOUT = "collective_timeout"  # a torch.distributed collective timed out / hung
    OUT_OF_MEMORY = "out_of_memory"  # the engine's own OOM (device or host allocation failed)
    OOM_KILLED = "oom_killed"  # the kernel's OOM killer (set by the operator, never the engine)
    RANK_JOIN_TIMEOUT = "rank_join_timeout"  # a headless rank never joined, or rank 0 never came
    PEER_LOST = "peer_lost"  # another rank of the group died first; this one is a consequence
    CONFIG_ERROR = "config_error"  # bad flags or arguments: a restart cannot fix it
    MODEL_NOT_FOUND = "model_not_found"  # the model path/name does not exist: permanent
    STARTUP_ERROR = "startup_error"  # failed while loading weights or compiling, cause unclear
    SIGNALED = "signaled"  # killed by a signal nobody asked for (set by the operator)
    STALLED = "stalled"  # not Ready past the start-up deadline (set by the operator)
    UNEXPECTED_EXIT = "unexpected_exit"  # exited (even with 0) when the operator did not ask
    UNKNOWN = "unknown"  # plain text or nothing at all: the message is the log tail
    # The model fetch (shoal.contract.model_fetch), appended in issue 23:
    MODEL_ACCESS_DENIED = "model_access_denied"  # 401/403 or a gated repository: permanent
    DOWNLOAD_FAILED = "download_failed"  # network or hub error: transient, retried with back-off
    # Appended in issue 29:
    NODE_LOST = "node_lost"  # a rank's node NotReady/Unknown past its bound (set by the operator)


# Restarting the group cannot fix these; the operator stops and says so in a condition.
PERMANENT_CAUSES = frozenset({Cause.CONFIG_ERROR, Cause.MODEL_NOT_FOUND,
                              Cause.MODEL_ACCESS_DENIED})


def is_permanent(cause: Cause | str) -> bool:
    """True for causes a restart cannot fix (bad configuration, missing model)."""
    try:
        return Cause(cause) in PERMANENT_CAUSES
    except ValueError:
        return False


@dataclass(frozen=True)
class TerminationMessage:
    """One decoded termination message. `structured` is False when the text was not ours."""

    cause: Cause
    message: str
    rank: int | None = None
    exit_code: int | None = None
    pid: int | None = None
    time: str | None = None
    structured: bool = True
    process: str | None = None  # appended in issue 25

    @property
    def permanent(self) -> bool:
        return is_permanent(self.cause)

    def to_json(self) -> str:
        """Encode, truncating `message` so that the whole object fits MAX_MESSAGE_BYTES."""
        return encode(
            self.cause, self.message, rank=self.rank, exit_code=self.exit_code, pid=self.pid,
            time=self.time, process=self.process,
        )


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def encode(
    cause: Cause | str,
    message: str,
    *,
    rank: int | None = None,
    exit_code: int | None = None,
    pid: int | None = None,
    time: str | None = None,
    limit: int = MAX_MESSAGE_BYTES,
    process: str | None = None,
) -> str:
    """One JSON object within `limit` bytes (UTF-8); the message keeps its head and its tail,
    because the first line names the error and the last line names where it happened."""
    obj: dict = {"v": FORMAT_VERSION, "cause": Cause(cause).value, "rank": rank, "message": ""}
    for key, val in (("exitCode", exit_code), ("pid", pid), ("time", time),
                     ("process", process)):
        if val is not None:
            obj[key] = val
    if rank is None:
        del obj["rank"]
    room = limit - len(json.dumps(obj, ensure_ascii=False).encode())
    obj["message"] = _fit(message, room)
    text = json.dumps(obj, ensure_ascii=False)
    while len(text.encode()) > limit:  # escapes (quotes, newlines) grow the JSON: trim further
        room -= len(text.encode()) - limit
        obj["message"] = _fit(message, max(room, 0))
        text = json.dumps(obj, ensure_ascii=False)
    return text


def _fit(message: str, room: int) -> str:
    raw = message.encode()
    if len(raw) <= room:
        return message
    marker = " ... "
    keep = max(room - len(marker), 0)
    head, tail = raw[: keep // 2], raw[len(raw) - (keep - keep // 2) :] if keep else b""
    return head.decode(errors="ignore") + marker + tail.decode(errors="ignore") if keep else ""


def write_termination_message(
    cause: Cause | str,
    message: str,
    *,
    rank: int | None = None,
    exit_code: int | None = None,
    path: str | None = None,
    process: str | None = None,
    pid: int | None = None,
) -> bool:
    """Write the message where Kubernetes looks for it. Never raises: this runs on a failure
    path, and a missing or read-only file must not mask the original error.

    The path is `$SHOAL_TERMINATION_LOG`, else /dev/termination-log if it exists (in a pod).
    `process` and `pid` name the process that died when the writer is not that process (the
    supervisor in front of a stock vLLM); `pid` defaults to the writer's own."""
    path = path or os.environ.get(env.TERMINATION_LOG) or DEFAULT_PATH
    if path == DEFAULT_PATH and not os.path.exists(path):
        return False
    text = encode(cause, message, rank=rank, exit_code=exit_code,
                  pid=os.getpid() if pid is None else pid, time=_now(), process=process)
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return True
    except OSError:
        return False


# Plain-text classification for messages that are not ours: stock vLLM images write no
# termination message, so the kubelet's log tail (FallbackToLogsOnError) is all there is. Shoal's
# own engine states its cause (shoal.engine.core.engine_core_proc.death.death_cause) and never
# goes through these rules.
# Permanent causes need a rule that only the permanent fault produces (argparse's own line,
# Hugging Face's "not a valid model identifier"), never a generic phrase: "No such file or
# directory" is also a missing /dev/shm/nccl-* segment, and a ValueError is also a bad batch.
# Each rule carries texts it must match and texts it must not
# (tests/operator/test_op_termination.py).
@dataclass(frozen=True)
class TextRule:
    pattern: re.Pattern
    cause: Cause
    matches: tuple[str, ...]
    must_not_match: tuple[str, ...]


TEXT_RULES: tuple[TextRule, ...] = (
    TextRule(re.compile(r"out of memory|OutOfMemoryError", re.I), Cause.OUT_OF_MEMORY,
             ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
              "RuntimeError: CUDA error: out of memory"),
             ("INFO: GPU KV cache usage: 93.0%", "INFO: # CPU blocks: 7281, memory 1.0 GiB")),
    TextRule(re.compile(r"(NCCL|Gloo|collective|watchdog).{0,80}(timeout|timed out)", re.I | re.S),
             Cause.COLLECTIVE_TIMEOUT,
             ("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7)",
              "torch.distributed.DistBackendError: NCCL communicator was aborted: timed out"),
             ("INFO: NCCL version 2.21.5+cuda12.4", "httpx.ReadTimeout: request timed out")),
    TextRule(re.compile(r"is not a local folder and is not a valid model identifier|"
                        r"Repository Not Found for url|Incorrect path_or_model_id"),
             Cause.MODEL_NOT_FOUND,
             ("OSError: /models/llama is not a local folder and is not a valid model identifier "
              "listed on 'https://huggingface.co/models'",
              "huggingface_hub.errors.RepositoryNotFoundError: 404 Client Error. Repository Not "
              "Found for url: https://huggingface.co/api/models/x/y"),
             ("FileNotFoundError: [Errno 2] No such file or directory: '/dev/shm/nccl-Xk2b'",
              "ValueError: path /tmp/cache/segment-3 does not exist")),
    TextRule(re.compile(r"(?m)^[\w. /-]+: error: (unrecognized arguments|argument |"
                        r"the following arguments are required)|"
                        r"validation errors? for \w*Config\b"),
             Cause.CONFIG_ERROR,
             ("usage: vllm serve [-h] ...\nvllm serve: error: unrecognized arguments: "
              "--shutdown-timeout 30",
              "api_server.py: error: argument --dtype: invalid choice: 'fp7'",
              "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig"),
             ("ValueError: max_tokens must be at least 1, got 0",
              "ERROR: request 7: error: argument list too long for the tokenizer")),
    TextRule(re.compile(r"EngineDeadError|EngineCore.{0,40}(died|failed)|Traceback", re.I),
             Cause.ENGINE_ERROR,
             ("vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.",
              "Traceback (most recent call last):\n  File \"x.py\""),
             ("INFO: EngineCore started in 4.2 s",)),
)


def classify_text(text: str) -> Cause:
    """Best-effort cause for free text; UNKNOWN when nothing matches."""
    for rule in TEXT_RULES:
        if rule.pattern.search(text):
            return rule.cause
    return Cause.UNKNOWN


def parse_termination_message(text: str | None) -> TerminationMessage:
    """Decode what the engine wrote; accept anything (None, empty, a log tail, foreign JSON)."""
    text = (text or "").strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except ValueError:
            obj = None
        if isinstance(obj, dict) and "cause" in obj:
            try:
                cause = Cause(obj["cause"])
            except ValueError:
                cause = Cause.UNKNOWN
            return TerminationMessage(
                cause=cause,
                message=str(obj.get("message", "")),
                rank=_int_or_none(obj.get("rank")),
                exit_code=_int_or_none(obj.get("exitCode")),
                pid=_int_or_none(obj.get("pid")),
                time=obj.get("time") if isinstance(obj.get("time"), str) else None,
                process=obj.get("process") if isinstance(obj.get("process"), str) else None,
            )
    return TerminationMessage(cause=classify_text(text), message=text, structured=False)


def _int_or_none(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
