"""EngineCore: the pure inner loop. It owns the scheduler (and through it the KV cache manager
and every block table) and the executor; it knows nothing about sockets or processes.

`step()` is the whole engine: schedule -> execute -> apply aborts that arrived meanwhile ->
update from output, returning a StepOutput (core/sched_output.py). The process half of the pair
(core/engine_core_proc/busy_loop.py) calls `add_request`, `abort_requests` / `enqueue_aborts`
and `step()`; `InprocClient` (core_client/inproc.py) calls them directly.
With --kv-events-config enabled it also owns the KV event publisher (kv_event_publisher.py):
the prefix-cache changes of each step, and of a reset, go out as one KVEventBatch.
"""

from __future__ import annotations

import logging
import threading
import time

import msgspec
from shoal.engine import wire
from shoal.engine.config import EngineConfig
from shoal.engine.core.kv_events import KVEventBatch
from shoal.engine.core.request import Request, RequestStatus
from shoal.engine.core.request_queue import check_policy
from shoal.engine.core.sched_output import StepOutput
from shoal.engine.core.scheduler import Scheduler
from shoal.engine.errors import ConfigError
from shoal.engine.structured.manager import StructuredOutputManager

log = logging.getLogger(__name__)


def default_executor_class(config: EngineConfig):
    """One rank runs inline; a tensor-parallel group runs in worker processes."""
    if config.world_size > 1:
        from shoal.engine.executor.multiproc_executor import MultiprocExecutor

        return MultiprocExecutor
    from shoal.engine.executor.uniproc_executor import UniProcExecutor

    return UniProcExecutor


class EngineCore:
    # Methods a client may call by name through `call_utility` (the UTILITY request).
    UTILITY_METHODS = frozenset({"get_kv_stats", "reset_prefix_cache", "get_engine_info",
                                 "has_unfinished_requests", "add_lora", "remove_lora",
                                 "list_loras"})

    def __init__(self, config: EngineConfig, executor_class=None, *,
                 scheduling_policy: str = "fcfs") -> None:
        """`scheduling_policy`: vLLM's --scheduling-policy, "fcfs" or "priority"
        (core/request_queue.py)."""
        check_policy(scheduling_policy)  # before any model loads
        if executor_class is None:
            executor_class = default_executor_class(config)
        self.config = config
        self.model_executor = executor_class(config)
        self.num_blocks = self.model_executor.determine_num_kv_blocks()
        self.block_size = config.block_size
        capacity = (self.num_blocks - 1) * self.block_size
        if capacity < config.max_model_len:
            self.model_executor.shutdown()
            raise ConfigError(
                f"the KV cache holds {capacity} tokens ({self.num_blocks} blocks of "
                f"{self.block_size}), fewer than max_model_len={config.max_model_len}: one "
                "request could never finish. Raise the KV budget (kv_cache_memory_bytes / "
                "SHOAL_KV_CACHE_SPACE / num_kv_blocks; gpu_memory_utilization on CUDA) or "
                "lower max_model_len.")
        self.max_model_len = config.max_model_len
        self.model_executor.initialize_kv_cache(self.num_blocks)
        self.vocab_size = self.model_executor.get_vocab_size()
        self.structured_output_manager = StructuredOutputManager(config.tokenizer_path,
                                                                 self.vocab_size)
        self.scheduler = Scheduler(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            enable_prefix_caching=config.enable_prefix_caching,
            enable_chunked_prefill=config.enable_chunked_prefill,
            structured_output_manager=self.structured_output_manager,
            policy=scheduling_policy,
            max_loras=None if config.lora_config is None else config.lora_config.max_loras,
        )
        self.loras: dict[int, wire.LoRARequest] = {}  # adapters read and checked, by id
        self.kv_event_publisher = self._start_kv_events(config)
        self._pending_aborts: list[str] = []
        self._aborts_lock = threading.Lock()
        log.info("engine core ready: %d KV blocks of %d tokens, max_model_len %d",
                 self.num_blocks, self.block_size, self.max_model_len)

    def _start_kv_events(self, config: EngineConfig):
        """The publisher, with the block pool collecting events, or None (nothing built)."""
        events = config.kv_events_config
        if events is None or not events.publishes:
            if events is not None and events.publisher == "zmq":
                log.warning("KV cache events are disabled (enable_kv_cache_events false) but "
                            "--kv-events-config names a publisher: nothing is published")
            return None
        if not config.enable_prefix_caching:
            log.warning("KV cache events are on, but prefix caching is not enabled: no block "
                        "is ever stored, so no event is published (--enable-prefix-caching)")
        from shoal.engine.core.kv_event_publisher import ZmqEventPublisher

        try:
            publisher = ZmqEventPublisher(events)
        except BaseException:  # the endpoint cannot bind: nothing may be left running
            self.structured_output_manager.shutdown()
            self.model_executor.shutdown()
            raise
        self.scheduler.kv.pool.enable_events()
        return publisher

    def _publish_kv_events(self) -> None:
        events = self.scheduler.kv.pool.take_events()
        if events:
            self.kv_event_publisher.publish(KVEventBatch(ts=time.time(), events=events))

    # -- requests ------------------------------------------------------------------------

    def add_request(self, request: wire.EngineCoreRequest) -> None:
        """Validate and queue one request; ValueError (saying what to change) if it is bad."""
        params = request.sampling_params
        params.verify()
        if params.n != 1:
            raise ValueError(f"request {request.request_id}: the engine runs one sequence per "
                             f"request (n=1), got n={params.n}; fan n out into n requests.")
        prompt = request.prompt_token_ids
        if not prompt:
            raise ValueError(f"request {request.request_id}: the prompt is empty; send at least "
                             "one token.")
        if len(prompt) >= self.max_model_len:
            raise ValueError(
                f"request {request.request_id}: the prompt has {len(prompt)} tokens but the "
                f"context length (max_model_len) is {self.max_model_len}; shorten the prompt "
                f"to at most {self.max_model_len - 1} tokens.")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"request {request.request_id}: token ids {bad[:5]} are outside "
                             f"the vocabulary [0, {self.vocab_size}).")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.config.max_logprobs:
                raise ValueError(f"request {request.request_id}: {name} must be between 0 and "
                                 f"{self.config.max_logprobs} (max_logprobs), got {value}.")
        room = self.max_model_len - len(prompt)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        if params.min_tokens > max_tokens:
            raise ValueError(f"request {request.request_id}: min_tokens={params.min_tokens} "
                             f"cannot be met: only {max_tokens} tokens fit in the context.")
        if params.structured_outputs is not None:
            try:
                self.structured_output_manager.validate(params.structured_outputs)
            except ValueError as exc:
                raise ValueError(f"request {request.request_id}: invalid structured output "
                                 f"({params.structured_outputs.kind}): {exc}") from None
        if request.lora_request is not None:
            self._check_lora(request)
        req = Request.from_engine_core_request(request, max_tokens)
        req.queued_at = time.monotonic()
        self.scheduler.add_request(req)

    def _check_lora(self, request: wire.EngineCoreRequest) -> None:
        """A request's adapter is read and checked before the request is queued (a bad one is
        the request's error, never a failed step)."""
        lora = request.lora_request
        if self.config.lora_config is None:
            raise ValueError(f"request {request.request_id}: LoRA adapter "
                             f"{lora.lora_name!r} asked for, but LoRA is not enabled (start "
                             "the engine with --enable-lora / enable_lora=True).")
        if lora.lora_int_id not in self.loras:
            self.add_lora(lora)
        else:
            self._check_same(lora)

    def _check_same(self, lora: wire.LoRARequest) -> None:
        known = self.loras[lora.lora_int_id]
        if (known.lora_name, known.lora_path) != (lora.lora_name, lora.lora_path):
            raise ValueError(f"LoRA id {lora.lora_int_id} is adapter {known.lora_name!r} "
                             f"({known.lora_path}); {lora.lora_name!r} ({lora.lora_path}) "
                             "cannot take the same id: give each adapter its own lora_int_id.")

    # -- LoRA adapters (utilities: vLLM's add_lora / remove_lora / list_loras) -------------

    def add_lora(self, lora) -> bool:
        """Read and check an adapter into the workers' host cache; ValueError (LoRALoadError)
        naming what cannot be applied. True if it was new."""
        if not isinstance(lora, wire.LoRARequest):  # a UTILITY call's msgpack array
            lora = msgspec.convert(lora, wire.LoRARequest)
        if self.config.lora_config is None:
            raise ValueError("LoRA is not enabled: start the engine with --enable-lora.")
        if lora.lora_int_id < 1:
            raise ValueError(f"LoRA adapter {lora.lora_name!r}: lora_int_id must be a positive "
                             f"integer, got {lora.lora_int_id}.")
        if lora.lora_int_id in self.loras:
            self._check_same(lora)
        new = all(self.model_executor.collective_rpc("add_lora", (lora,)))
        self.loras[lora.lora_int_id] = lora
        return new

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (requests still running with it read it again from its path)."""
        self.loras.pop(lora_int_id, None)
        return all(self.model_executor.collective_rpc("remove_lora", (lora_int_id,)))

    def list_loras(self) -> list[int]:
        return sorted(self.loras)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort now (call from the thread that steps). Idempotent."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def enqueue_aborts(self, request_ids: list[str]) -> None:
        """Thread-safe: aborts applied by the next step, right after its forward pass."""
        with self._aborts_lock:
            self._pending_aborts.extend(request_ids)

    def _process_aborts_queue(self) -> None:
        with self._aborts_lock:
            pending, self._pending_aborts = self._pending_aborts, []
        if pending:
            self.abort_requests(pending)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def make_stats(self) -> wire.SchedulerStats:
        """Fresh scheduler gauges, also between steps (an idle engine publishes these once)."""
        return self.scheduler.make_stats()

    # -- the loop ------------------------------------------------------------------------

    def step(self) -> StepOutput:
        """Schedule, execute, and make output (decode tokens as columns: see StepOutput)."""
        if not self.scheduler.has_requests():
            self._process_aborts_queue()
            return StepOutput()
        scheduler_output = self.scheduler.schedule()
        first_scheduled = self._first_scheduled(scheduler_output)
        if not scheduler_output.req_ids and self.structured_output_manager.num_compiling():
            # Nothing runnable but grammars compiling: sleep on them instead of spinning.
            self.structured_output_manager.wait_for_compile(timeout=0.01)
        model_output = self.model_executor.execute_model(scheduler_output)
        # Aborts that arrived during the forward pass take effect on this same step.
        self._process_aborts_queue()
        step = self.scheduler.update_from_output(scheduler_output, model_output)
        if self.kv_event_publisher is not None:
            self._publish_kv_events()
        step.scheduler_stats = self.make_stats()
        step.scheduler_stats.first_scheduled = first_scheduled
        return step

    def _first_scheduled(self, scheduler_output) -> list[tuple[str, float]] | None:
        """[request id, seconds queued] for requests scheduled for the first time (a request
        preempted and rescheduled is not new: its queued_at is spent)."""
        if not scheduler_output.new_requests:
            return None
        now, waited = time.monotonic(), []
        for nr in scheduler_output.new_requests:
            req = self.scheduler.requests.get(nr.req_id)
            if req is not None and req.queued_at is not None:
                waited.append((nr.req_id, now - req.queued_at))
                req.queued_at = None
        return waited or None

    # -- utilities (allow-listed in UTILITY_METHODS) --------------------------------------

    def call_utility(self, method: str, args: tuple | list = ()):
        if method not in self.UTILITY_METHODS:
            raise ValueError(f"unknown utility method {method!r}; allowed: "
                             f"{sorted(self.UTILITY_METHODS)}")
        return getattr(self, method)(*args)

    def get_kv_stats(self) -> dict:
        pool = self.scheduler.kv.pool
        return {"num_blocks": pool.num_blocks, "num_usable_blocks": pool.num_blocks - 1,
                "num_free_blocks": pool.num_free_blocks, "usage": pool.usage,
                "num_cached_blocks": len(pool.cached)}

    def reset_prefix_cache(self) -> bool:
        done = self.scheduler.kv.reset_prefix_cache()
        if self.kv_event_publisher is not None:
            self._publish_kv_events()  # AllBlocksCleared now, not at the next step
        return done

    def get_engine_info(self) -> dict:
        """What a frontend learns at start-up (vLLM's ready response)."""
        return {"max_model_len": self.max_model_len, "num_blocks": self.num_blocks,
                "block_size": self.block_size, "max_num_seqs": self.config.max_num_seqs,
                "max_num_batched_tokens": self.config.max_num_batched_tokens,
                "vocab_size": self.vocab_size, "model": self.config.model,
                "protocol_version": wire.PROTOCOL_VERSION}

    def shutdown(self) -> None:
        self.structured_output_manager.shutdown()
        self.model_executor.shutdown()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.shutdown()
