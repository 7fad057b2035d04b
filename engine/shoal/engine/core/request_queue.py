"""The scheduler's waiting queue, one class per `--scheduling-policy` (vLLM 0.32's
vllm/v1/core/sched/request_queue.py, the same two policies and the same order):

- "fcfs": first come, first served; a preempted request goes back to the front.
- "priority": the smallest (priority, arrival_time, request_id) first (Request.__lt__); there is
  no front: a preempted request is ordered by its key like any other.

Both answer the same calls (add, prepend, peek, pop, remove, iteration in service order), so the
scheduler is written once for both.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Iterator

from shoal.engine.core.request import Request

FCFS, PRIORITY = "fcfs", "priority"
POLICIES = (FCFS, PRIORITY)


class FCFSRequestQueue(deque):
    """Arrival order; `prepend` puts a request back at the front (preemption)."""

    def add(self, request: Request) -> None:
        self.append(request)

    def prepend(self, request: Request) -> None:
        self.appendleft(request)

    def prepend_all(self, requests: list[Request]) -> None:
        """Put `requests` back at the front in their own order."""
        self.extendleft(reversed(requests))

    def peek(self) -> Request:
        return self[0]

    def pop_next(self) -> Request:
        return self.popleft()


class PriorityRequestQueue:
    """A heap on Request's order: lower priority value first, then earlier arrival."""

    def __init__(self) -> None:
        self._heap: list[Request] = []

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, request)

    prepend = add  # no front in a priority queue: ordered by (priority, arrival) as any other

    def prepend_all(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.add(request)

    def peek(self) -> Request:
        if not self._heap:
            raise IndexError("peek from an empty queue")
        return self._heap[0]

    def pop_next(self) -> Request:
        return heapq.heappop(self._heap)

    def remove(self, request: Request) -> None:
        self._heap.remove(request)
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """In service order (a sorted copy; the heap itself is left alone)."""
        return iter(sorted(self._heap))


def priority_refusal(priority: int) -> str:
    """vLLM's words (its V0 engine's; its request fields document the error) for a priority
    other than 0 under first-come-first-served scheduling."""
    return f"Got priority {priority} but Priority scheduling is not enabled."


def check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"scheduling_policy must be one of {list(POLICIES)}, got {policy!r}.")


def make_request_queue(policy: str) -> FCFSRequestQueue | PriorityRequestQueue:
    check_policy(policy)
    return PriorityRequestQueue() if policy == PRIORITY else FCFSRequestQueue()
