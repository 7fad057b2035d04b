"""What crosses from the scheduler to the model runner each step, and back.

Control data only (token ids, positions, block ids): the runner owns every tensor. The structs
are plain lists so that a multiprocess executor can serialise them without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.engine import wire


@dataclass
class NewRequestData:
    """Sent the first time a request is scheduled: what the runner keeps for sampling."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: wire.SamplingParams
    eos_token_id: int | None


@dataclass
class SchedulerOutput:
    """One step's work. Lists are parallel, one entry per scheduled request, in batch order."""

    req_ids: list[str] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)  # tokens computed this step
    start_positions: list[int] = field(default_factory=list)  # tokens computed before
    block_ids: list[list[int]] = field(default_factory=list)  # the request's whole block table
    sample: list[bool] = field(default_factory=list)  # this step reaches the last known token
    new_requests: list[NewRequestData] = field(default_factory=list)
    finished_req_ids: set[str] = field(default_factory=set)  # runner drops their state
    preempted_req_ids: list[str] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return {r: len(t) for r, t in zip(self.req_ids, self.token_ids, strict=True)}


@dataclass
class ModelRunnerOutput:
    """The runner's answer: one sampled token per request whose `sample` flag was set."""

    sampled: dict[str, int] = field(default_factory=dict)
