"""AsyncLLM: the frontend's engine. Lives in the API-server process, on its asyncio loop.

Owns the InputProcessor (tokenizer), the OutputProcessor (request states and collectors), the
AsyncMPClient (sockets + the engine process) and ONE output-handler task that pulls each step's
StepOutput and fans it out to the collectors, yielding to the loop between chunks.

`generate()` is an async generator of RequestOutput deltas. If its consumer goes away (client
disconnect: the generator is closed or cancelled), the request is aborted here and in the engine,
which frees its KV blocks. If the engine dies, every in-flight request fails with EngineDeadError
naming the root cause, and `on_engine_dead` callbacks run (the server exits non-zero).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable

from shoal.engine.core_client.async_client import AsyncMPClient
from shoal.engine.errors import (
    EngineDeadError,
    EngineStoppedError,
    EngineUnavailableError,
    InvalidRequestError,
    RequestRejectedError,
)
from shoal.engine.frontend.input_processor import InputProcessor
from shoal.engine.frontend.metrics import FrontendMetrics
from shoal.engine.frontend.output_processor import OutputProcessor, RequestOutput
from shoal.engine.wire import SamplingParams

logger = logging.getLogger("shoal.engine.frontend")

# Outputs processed between yields to the event loop (vLLM's VLLM_V1_OUTPUT_PROC_CHUNK_SIZE).
OUTPUT_CHUNK_SIZE = 128


def _load_tokenizer(model: str):
    from shoal.engine.tokenizer import load_tokenizer

    return load_tokenizer(model)


def _extra_eos_ids(model: str) -> list[int]:
    import json
    from pathlib import Path

    path = Path(model) / "generation_config.json"
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError):
        return []
    return [eos] if isinstance(eos, int) else list(eos or [])


class AsyncLLM:
    def __init__(self, config, *, served_model_name: str | None = None,
                 shutdown_timeout: float = 0.0, host: str | None = None,
                 log_level: str = "INFO", scheduling_policy: str = "fcfs") -> None:
        """Blocking: starts the engine process and waits for it to be ready. The tokenizer loads
        in a thread meanwhile. Call `start()` on the running loop before serving.
        `scheduling_policy`: vLLM's --scheduling-policy, "fcfs" or "priority"."""
        self.config = config
        self.model_name = served_model_name or config.model
        tok: dict = {}

        def load() -> None:
            try:
                tok["tokenizer"] = _load_tokenizer(config.tokenizer_path)
            except Exception as exc:  # noqa: BLE001 - re-raised below
                tok["error"] = exc

        loader = threading.Thread(target=load, name="tokenizer-load")
        loader.start()
        try:
            self.engine_core = AsyncMPClient(config, shutdown_timeout=shutdown_timeout,
                                             host=host, log_level=log_level,
                                             scheduling_policy=scheduling_policy)
        finally:
            loader.join()
        if "error" in tok:
            self.engine_core.shutdown()
            raise tok["error"]
        self.tokenizer = tok["tokenizer"]
        ready = self.engine_core.ready
        self.ready = ready
        self.max_model_len = ready.max_model_len
        self.input_processor = InputProcessor(
            self.tokenizer, max_model_len=ready.max_model_len,
            vocab_size=ready.vocab_size or len(self.tokenizer),
            extra_eos_token_ids=_extra_eos_ids(config.model),
            scheduling_policy=scheduling_policy)
        self.metrics = FrontendMetrics(
            self.model_name, max_model_len=ready.max_model_len,
            cache_info=_cache_info(config, ready),
            max_loras=None if config.lora_config is None else config.lora_config.max_loras)
        self.output_processor = OutputProcessor(self.tokenizer, self.metrics)
        self.draining = False
        self.dead_error: EngineDeadError | None = None
        self.stopped = False
        self.on_engine_dead: list[Callable[[EngineDeadError], None]] = []
        self.on_engine_stopped: list[Callable[[], None]] = []
        self._handler: asyncio.Task | None = None
        self._abort_tasks: set[asyncio.Task] = set()

    # ----- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self.engine_core.start()
        self._handler = asyncio.get_running_loop().create_task(self._output_handler())

    @property
    def is_healthy(self) -> bool:
        return self.dead_error is None and not self.stopped and not self.draining

    def begin_shutdown(self) -> None:
        """Stop admitting requests (503); the engine process is told by its own SIGTERM."""
        self.draining = True

    def shutdown(self, timeout: float = 30.0) -> int | None:
        if self._handler is not None:
            self._handler.cancel()
        self.engine_core.shutdown(timeout)
        return self.engine_core.engine.proc.returncode

    # ----- requests ----------------------------------------------------------------------------

    def _check_available(self) -> None:
        if self.dead_error is not None:
            raise self.dead_error
        if self.stopped or self.draining:
            raise EngineUnavailableError("the server is shutting down and takes no new "
                                         "requests; retry on another replica")

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str, priority: int = 0,
                       lora_request=None) -> AsyncIterator[RequestOutput]:
        """Deltas until the request finishes. Raises InvalidRequestError (400) before anything
        is sent, RequestRejectedError, EngineUnavailableError (503) or EngineDeadError (500).
        `priority`: vLLM's (lower first, under --scheduling-policy priority)."""
        self._check_available()
        if params.n != 1:
            raise InvalidRequestError("AsyncLLM.generate takes n=1; fan out n>1 above it.")
        engine_id = self.input_processor.engine_request_id(request_id)
        request = self.input_processor.process(engine_id, prompt_token_ids, params, priority,
                                               lora_request)
        collector = self.output_processor.add_request(
            engine_id, request_id, len(prompt_token_ids), params)
        finished = False
        try:
            await self.engine_core.add_request_async(request)
            while not finished:
                out = collector.get_nowait() or await collector.get()
                finished = out.finished
                yield out
        finally:
            if not finished:  # consumer gone (disconnect/cancel) or an error: free the engine
                self.abort(engine_id)

    def abort(self, engine_id: str) -> None:
        """Retire the request here now; send the engine abort from a task of its own, because
        the caller may be inside a cancelled scope where every await raises again."""
        if not self.output_processor.abort_request(engine_id):
            return  # already finished (or failed) here: the engine is done with it too
        if self.dead_error is None and not self.stopped:
            logger.info("request %s aborted (client gone)", engine_id)
            task = asyncio.get_running_loop().create_task(self._send_abort([engine_id]))
            self._abort_tasks.add(task)
            task.add_done_callback(self._abort_tasks.discard)

    async def _send_abort(self, engine_ids: list[str]) -> None:
        try:
            await self.engine_core.abort_requests_async(engine_ids)
        except Exception:  # noqa: BLE001 - the socket may be closing at shutdown
            logger.debug("abort of %s not sent", engine_ids)

    async def call_utility(self, method: str, *args):
        self._check_alive()
        return await self.engine_core.call_utility_async(method, *args)

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise self.dead_error

    # ----- the one output handler --------------------------------------------------------------

    async def _output_handler(self) -> None:
        op, client, metrics = self.output_processor, self.engine_core, self.metrics
        loop = asyncio.get_running_loop()
        try:
            while True:
                step = await client.get_output_async()
                if step.scheduler_stats is not None:  # before outputs: a request may finish now
                    op.record_first_scheduled(step.scheduler_stats.first_scheduled)
                for r in step.rejected or ():
                    op.fail_request(r.request_id, RequestRejectedError(r.message, r.status))
                to_abort = op.process_tokens(step.decode_req_ids, step.decode_token_ids)
                if to_abort:
                    await client.abort_requests_async(to_abort)
                items = step.outputs
                for start in range(0, len(items), OUTPUT_CHUNK_SIZE):
                    to_abort = op.process_outputs(items[start:start + OUTPUT_CHUNK_SIZE])
                    if to_abort:
                        await client.abort_requests_async(to_abort)
                    if start + OUTPUT_CHUNK_SIZE < len(items):
                        await asyncio.sleep(0)
                metrics.record_step(step.scheduler_stats, loop.time())
                metrics.record_iteration(*op.take_step_tokens())
        except EngineDeadError as err:
            self.dead_error = err
            metrics.engine_alive.set(0)
            logger.error("engine died: %s; failing %d in-flight requests", err.dead.describe(),
                         len(op.request_states))
            op.propagate_error(err)
            for cb in self.on_engine_dead:
                cb(err)
        except EngineStoppedError as err:
            self.stopped = True
            metrics.engine_alive.set(0)
            op.propagate_error(EngineUnavailableError(f"{err}; the server is shutting down"))
            for cb in self.on_engine_stopped:
                cb()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a frontend bug must not hang every request
            logger.exception("output handler failed")
            op.propagate_error(exc)
            raise


def _cache_info(config, ready) -> dict:
    """vllm:cache_config_info's labels (vLLM's CacheConfig names) for what the engine sized."""
    return {"block_size": ready.block_size, "num_gpu_blocks": ready.num_blocks,
            "num_cpu_blocks": None, "gpu_memory_utilization": config.gpu_memory_utilization,
            "enable_prefix_caching": ready.enable_prefix_caching}
