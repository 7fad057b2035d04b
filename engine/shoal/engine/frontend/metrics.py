"""Prometheus metrics with vLLM's names and labels, so vLLM dashboards, KEDA triggers and
autoscalers work unchanged. Fed by the output handler: scheduler gauges from each step's
SchedulerStats, token counters and tokens-per-step as each step's outputs arrive (vLLM's
IterationStats: a prompt counts when its first token arrives), per-request histograms when a
request finishes.

Phase timings, as vLLM defines them: queue = first scheduled - arrival in the engine (measured by
the engine, SchedulerStats.first_scheduled); prefill = first token - first scheduled; decode =
last token - first token; inference = prefill + decode. The token times are the frontend's
(arrival of the step's output) and "first scheduled" is the frontend's arrival time plus the
engine-measured queue time, so every duration is taken on one clock.

Labels: model_name (the served model name) and engine (the engine index, "0").
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from shoal.engine.wire import SchedulerStats

# vLLM's buckets (seconds).
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
# vLLM's buckets for the request phase histograms (its request_latency_buckets) and for tokens
# per engine step.
PHASE_BUCKETS = E2E_BUCKETS
REQUEST_PARAMS_N_BUCKETS = [1, 2, 5, 10, 20]
ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
FINISH_REASONS = ("stop", "length", "abort", "error")


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to max_value (max_model_len)."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return buckets
            buckets.append(m * scale)
        scale *= 10


class FrontendMetrics:
    def __init__(self, model_name: str, engine: str = "0", max_model_len: int = 10000,
                 cache_info: dict | None = None, max_loras: int | None = None) -> None:
        """`max_model_len` caps the token histograms' buckets (vLLM's 1-2-5 series);
        `cache_info`: the KV cache's facts for vllm:cache_config_info (block_size,
        num_gpu_blocks, ...), the gauge llm-d's scheduler reads KV capacity from."""
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        self.values = {"model_name": model_name, "engine": engine}
        r = self.registry

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=r).labels(**self.values)

        def counter(name, doc):
            return Counter(name, doc, labels, registry=r).labels(**self.values)

        def hist(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(**self.values)

        self.running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.")
        # The names before vLLM 0.10 (older autoscalers and schedulers read them): the same
        # values as kv_cache_usage_perc and prefix_cache_queries / hits.
        self.gpu_cache_usage = gauge("vllm:gpu_cache_usage_perc",
                                     "GPU KV-cache usage. 1 means 100 percent usage.")
        self.engine_alive = gauge("shoal:engine_alive", "1 while the engine process is healthy.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.")
        self.iteration_tokens = hist("vllm:iteration_tokens_total",
                                     "Histogram of number of tokens per engine_step.",
                                     ITERATION_TOKEN_BUCKETS)
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions.")
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prefix-cache queries, in tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix-cache hits, in tokens.")
        self.gpu_prefix_queries = counter("vllm:gpu_prefix_cache_queries",
                                          "GPU prefix cache queries, in terms of number of "
                                          "queried tokens.")
        self.gpu_prefix_hits = counter("vllm:gpu_prefix_cache_hits",
                                       "GPU prefix cache hits, in terms of number of cached "
                                       "tokens.")
        success = Counter("vllm:request_success", "Finished requests, by finish reason.",
                          [*labels, "finished_reason"], registry=r)
        self.success = {reason: success.labels(**self.values, finished_reason=reason)
                        for reason in FINISH_REASONS}
        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token.",
                         TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Inter-token latency.", ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "End-to-end request latency.",
                        E2E_BUCKETS)
        def phase(name: str, what: str):
            return hist(f"vllm:request_{name}_time_seconds",
                        f"Histogram of time spent in {what} phase for request.", PHASE_BUCKETS)

        self.queue_time = phase("queue", "WAITING")
        self.inference_time = phase("inference", "RUNNING")
        self.prefill_time = phase("prefill", "PREFILL")
        self.decode_time = phase("decode", "DECODE")
        tokens = build_1_2_5_buckets(max_model_len)
        self.prompt_len = hist("vllm:request_prompt_tokens",
                               "Number of prefill tokens processed.", tokens)
        self.gen_len = hist("vllm:request_generation_tokens",
                            "Number of generation tokens processed.", tokens)
        self.tpot = hist("vllm:request_time_per_output_token_seconds",
                         "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.params_n = hist("vllm:request_params_n", "Histogram of the n request parameter.",
                             REQUEST_PARAMS_N_BUCKETS)
        self.params_max_tokens = hist("vllm:request_params_max_tokens",
                                      "Histogram of the max_tokens request parameter.", tokens)
        if cache_info is not None:  # vLLM's info gauge: no model_name, the engine label last
            info = {k: str(v) for k, v in cache_info.items()} | {"engine": engine}
            Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                  list(info), registry=r).labels(**info).set(1)
        # --enable-lora: vLLM's vllm:lora_requests_info (its three labels only; the value is
        # the time of the last update). One series: the current adapters, the old one dropped.
        self.max_loras = max_loras
        self.lora_info = None if max_loras is None else Gauge(
            "vllm:lora_requests_info", "Running stats on lora requests.",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=r)
        self.engine_alive.set(1)
        self._last_step_time: float | None = None

    def record_step(self, stats: SchedulerStats | None, now: float) -> None:
        if stats is None:
            return
        self.running.set(stats.num_running_reqs)
        self.waiting.set(stats.num_waiting_reqs)
        self.kv_usage.set(stats.kv_cache_usage)
        self.gpu_cache_usage.set(stats.kv_cache_usage)
        if stats.num_preemptions:
            self.preemptions.inc(stats.num_preemptions)
        if stats.prefix_cache_queries:
            self.prefix_queries.inc(stats.prefix_cache_queries)
            self.gpu_prefix_queries.inc(stats.prefix_cache_queries)
        if stats.prefix_cache_hits:
            self.prefix_hits.inc(stats.prefix_cache_hits)
            self.gpu_prefix_hits.inc(stats.prefix_cache_hits)
        if self.lora_info is not None and stats.running_lora_adapters is not None:
            self.lora_info.clear()
            self.lora_info.labels(
                max_lora=str(self.max_loras),
                waiting_lora_adapters=",".join(stats.waiting_lora_adapters or {}),
                running_lora_adapters=",".join(stats.running_lora_adapters)).set_to_current_time()
        self._last_step_time = now

    def record_iteration(self, prompt_tokens: int, generation_tokens: int) -> None:
        """One engine step's outputs were processed: the token counters move now, not when
        requests end; steps that produced no token are not observed."""
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens)
        if generation_tokens:
            self.generation_tokens.inc(generation_tokens)
        if prompt_tokens + generation_tokens:
            self.iteration_tokens.observe(prompt_tokens + generation_tokens)

    def record_finished(self, state, reason: str, now: float) -> None:
        """One request finished (any reason): per-request histograms (see the module docstring
        for the phase timings)."""
        self.success.get(reason, self.success["error"]).inc()
        self.prompt_len.observe(state.prompt_len)
        max_tokens = getattr(getattr(state, "params", None), "max_tokens", None)
        if max_tokens:  # as vLLM: the engine request's max_tokens, once it is known
            self.params_max_tokens.observe(max_tokens)
        self.gen_len.observe(state.num_output_tokens)
        self.e2e.observe(now - state.arrival)
        if state.queue_time is not None:
            self.queue_time.observe(state.queue_time)
        if state.first_token_time is not None:
            self.ttft.observe(state.first_token_time - state.arrival)
            if state.queue_time is not None:
                scheduled = state.arrival + state.queue_time
                self.prefill_time.observe(max(0.0, state.first_token_time - scheduled))
                self.inference_time.observe(max(0.0, state.last_token_time - scheduled))
            decode = state.last_token_time - state.first_token_time
            self.decode_time.observe(decode)
            # vLLM's: the decode time per token after the first (0 for a single token).
            n = state.num_output_tokens - 1
            self.tpot.observe(decode / n if n > 0 else 0.0)
        for itl in state.itls:
            self.itl.observe(itl)

    def record_params_n(self, n: int) -> None:
        """One prompt of a request fanned out into n choices (vLLM's parent request)."""
        self.params_n.observe(n)

    def render(self, names: Iterable[str] | None = None) -> bytes:
        return exposition(self.registry, names)


def exposition(registry: CollectorRegistry, names: Iterable[str] | None = None) -> bytes:
    """The text format of every series of `registry`, or of the series `names` (sample names,
    as prometheus_client's `name[]` filter takes them: a histogram's are NAME_bucket, ...)."""
    return generate_latest(registry if names is None else registry.restricted_registry(names))
