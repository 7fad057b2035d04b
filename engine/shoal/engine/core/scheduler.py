"""Scheduler: decides, every step, which requests compute how many tokens.

Contract (vLLM V1 style):
- No prefill/decode phases. Each request's `num_computed_tokens` chases `num_tokens`; one step
  schedules at most `max_num_batched_tokens` tokens over at most `max_num_seqs` running requests.
- Running requests are scheduled first, in the order they were admitted; then waiting ones in
  the waiting queue's order (request_queue.py: arrival under `policy="fcfs"`, the smallest
  (priority, arrival) under "priority", vLLM's --scheduling-policy) while budget and seats
  remain. A prompt longer than the remaining budget is chunked (chunked prefill).
- When the KV manager answers "no blocks", the scheduler preempts a running request by
  recompute (its blocks are freed, it goes back to the waiting queue with
  num_computed_tokens = 0) and retries: under fcfs the *last* admitted one, under priority the
  one with the largest (priority, arrival), as vLLM; a victim already scheduled this step gives
  its tokens back. No waiting request is admitted in a step that preempted.
- `finish_requests` (aborts) is idempotent; unknown or finished ids are ignored.
- Finished requests free their blocks at once; their ids reach the runner in the next output.
- Structured output (with a StructuredOutputManager): a request whose grammar still compiles
  stays waiting and is passed over, so it never holds up the others; the constrained rows that
  sample get a token bitmask in the SchedulerOutput; each accepted token advances the request's
  matcher, and a complete grammar finishes the request ("stop"). A grammar that failed to
  compile finishes its request with finish_reason "error".
"""

from __future__ import annotations

import logging

from shoal.engine import wire
from shoal.engine.core.kv_cache_manager import KVCacheManager
from shoal.engine.core.request import Request, RequestStatus
from shoal.engine.core.request_queue import FCFS, PRIORITY, make_request_queue, priority_refusal
from shoal.engine.core.sched_output import (
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    StepOutput,
)

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        structured_output_manager=None,
        policy: str = FCFS,
        max_loras: int | None = None,
    ) -> None:
        """`max_loras`: --enable-lora's device slots: no step runs more distinct adapters
        (a waiting request whose adapter would be one too many waits, passed over, as vLLM's
        scheduler does); None = no LoRA."""
        self.max_loras = max_loras
        self.structured = structured_output_manager
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.waiting = make_request_queue(policy)
        self.running: list[Request] = []
        self._seen_by_runner: set[str] = set()
        self._finished_ids: set[str] = set()  # to tell the runner in the next SchedulerOutput
        self._abort_outputs: list[wire.EngineCoreOutput] = []
        self._num_preemptions = 0  # since the last stats
        self.step_counter = 0

    # -- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine; "
                             "request ids must be unique.")
        if request.use_structured_output:
            if self.structured is None:
                raise ValueError("this scheduler has no structured output manager.")
            self.structured.submit(request)
        if request.priority != 0 and self.policy != PRIORITY:
            raise ValueError(priority_refusal(request.priority))
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids, status: RequestStatus = RequestStatus.FINISHED_ABORTED):
        """Finish (abort) requests wherever they are. Idempotent."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            req = self.requests.get(rid)
            if req is None or req.status.finished:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            log.debug("request %s finished in the scheduler (%s)", rid, status.name)
            req.status = status
            self._free(req)
            if status.finish_reason is not None:
                self._abort_outputs.append(
                    wire.EngineCoreOutput(rid, [], finish_reason=status.finish_reason))

    def _free(self, req: Request) -> None:
        if req.grammar is not None:
            self.structured.free(req)
        self.kv.free(req)
        del self.requests[req.request_id]
        if req.request_id in self._seen_by_runner:
            self._seen_by_runner.discard(req.request_id)
            self._finished_ids.add(req.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def has_requests(self) -> bool:
        return self.has_unfinished_requests() or bool(self._finished_ids or self._abort_outputs)

    # -- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            while (new_blocks := self.kv.allocate_slots(req, n)) is None:
                victim = self._pick_victim()
                index = self.running.index(victim)
                del self.running[index]
                if index < i:  # an earlier one: it was scheduled this step, give its tokens back
                    i -= 1
                    budget += next(m for r, m in scheduled if r is victim)
                    scheduled = [(r, m) for r, m in scheduled if r is not victim]
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if new_blocks is None:
                break
            scheduled.append((req, n))
            budget -= n
            i += 1

        compiling: list[Request] = []  # passed over this step: their grammars are not ready
        loras = self._running_loras() if self.max_loras else None
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.max_num_seqs):
            req = self.waiting.peek()
            if req.grammar is not None and not self.structured.is_ready(req):
                compiling.append(self.waiting.pop_next())
                continue
            lora = req.lora_request
            if (loras is not None and lora is not None and lora.lora_int_id not in loras
                    and len(loras) >= self.max_loras):
                compiling.append(self.waiting.pop_next())  # its adapter would be one too many
                continue
            if req.grammar is not None and req.grammar.error is not None:
                self.finish_requests([req.request_id], RequestStatus.FINISHED_ERROR)
                continue
            # prompt_logprobs need the logits of every prompt position: no prefix-cache hit
            # (as vLLM), the whole prompt is computed (its blocks are still cached for others).
            if req.sampling_params.prompt_logprobs is None:
                hit_blocks, n_hit = self.kv.get_computed_blocks(req)
            else:
                hit_blocks, n_hit = [], 0
            n = req.num_tokens - n_hit
            if n > budget and not self.enable_chunked_prefill:
                break
            n = min(n, budget)
            if self.kv.allocate_slots(req, n, hit_blocks) is None:
                break
            self.waiting.pop_next()
            if loras is not None and lora is not None:
                loras.add(lora.lora_int_id)
            self.kv.record_lookup(req.num_tokens, n_hit)
            req.num_computed_tokens = n_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = n_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append((req, n))
            budget -= n
        self.waiting.prepend_all(compiling)
        return self._make_output(scheduled, preempted)

    def _running_loras(self) -> set[int]:
        return {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}

    def _lora_counts(self, requests) -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in requests:
            if r.lora_request is not None:
                name = r.lora_request.lora_name
                counts[name] = counts.get(name, 0) + 1
        return counts

    def _pick_victim(self) -> Request:
        """The running request to preempt: the last admitted (fcfs), or the one with the
        largest (priority, arrival) (priority), as vLLM's scheduler picks it."""
        if self.policy == PRIORITY:
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, req: Request) -> None:
        log.info("request %s preempted by recompute (%d tokens to recompute, %d free blocks)",
                 req.request_id, req.num_tokens, self.kv.num_free_blocks)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self._num_preemptions += 1
        self.waiting.prepend(req)

    def _make_output(self, scheduled, preempted) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self._finished_ids,
                              preempted_req_ids=[r.request_id for r in preempted])
        self._finished_ids = set()
        constrained: list[Request] = []
        for req, n in scheduled:
            rid, start = req.request_id, req.num_computed_tokens
            if rid not in self._seen_by_runner:
                self._seen_by_runner.add(rid)
                out.new_requests.append(NewRequestData(
                    rid, req.prompt_token_ids, req.sampling_params, req.eos_token_id,
                    req.lora_request))
            out.req_ids.append(rid)
            out.token_ids.append(req.all_token_ids[start:start + n])
            out.start_positions.append(start)
            out.block_ids.append(self.kv.block_ids(rid))
            out.sample.append(start + n == req.num_tokens)
            req.num_computed_tokens = start + n
            out.total_num_scheduled_tokens += n
            if out.sample[-1] and req.grammar is not None:
                constrained.append(req)
        if constrained:
            out.grammar_req_ids = [r.request_id for r in constrained]
            out.grammar_bitmask = self.structured.fill_bitmask(constrained)
        self.step_counter += 1
        return out

    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> StepOutput:
        step = StepOutput(outputs=self._abort_outputs)
        self._abort_outputs = []
        outputs = step.outputs
        decode_ids, decode_tokens = step.decode_req_ids, step.decode_token_ids
        for rid in sched.req_ids:
            req = self.requests.get(rid)
            token = result.sampled.get(rid)
            if req is None or token is None:  # aborted during the step, or a prefill chunk
                continue
            req.append_output_token(token)
            reason = self._check_stop(req, token)
            if reason is None and req.grammar is not None:
                reason = self._advance_grammar(req, token)
            lp = result.logprobs.get(rid) if result.logprobs else None
            if reason is None and req.num_output_tokens > 1 and lp is None:  # plain: columns
                decode_ids.append(rid)
                decode_tokens.append(token)
                continue
            out = wire.EngineCoreOutput(rid, [token], new_logprobs=lp)
            if result.prompt_logprobs:
                out.new_prompt_logprobs = result.prompt_logprobs.get(rid)
            if req.num_output_tokens == 1:
                out.num_cached_tokens = max(req.num_cached_tokens, 0)
            if reason is not None:
                out.finish_reason = reason.finish_reason
                out.stop_reason = req.stop_reason
                req.status = reason
                self.running.remove(req)
                self._free(req)
            outputs.append(out)
        return step

    def _advance_grammar(self, req: Request, token: int) -> RequestStatus | None:
        if not self.structured.accept(req, token):
            return None
        if req.grammar.matcher.is_error():  # a token the mask allowed was refused: a bug, loud
            log.error("request %s finished with an error: its grammar refused token %d",
                      req.request_id, token)
            return RequestStatus.FINISHED_ERROR
        return RequestStatus.FINISHED_STOPPED

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        if req.num_output_tokens < req.sampling_params.min_tokens:
            return None
        if token == req.eos_token_id and not req.sampling_params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if token in req.stop_token_ids:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        return None

    def make_stats(self) -> wire.SchedulerStats:
        queries, hits = self.kv.take_prefix_stats()
        stats = wire.SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv.pool.usage,
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            num_preemptions=self._num_preemptions,
            step_counter=self.step_counter,
        )
        if self.max_loras:
            stats.running_lora_adapters = self._lora_counts(self.running)
            stats.waiting_lora_adapters = self._lora_counts(self.waiting)
        self._num_preemptions = 0
        return stats
