"""The metrics schedulers and autoscalers read under vLLM's names (frontend/metrics.py):
vllm:cache_config_info (llm-d's KV capacity), the pre-0.10 gpu_* names, time per output token,
request_params_n / max_tokens, and the 1-2-5 token buckets up to max_model_len."""

from __future__ import annotations

import types

from prometheus_client.parser import text_string_to_metric_families
from shoal.engine.frontend.metrics import FrontendMetrics, build_1_2_5_buckets
from shoal.engine.wire import SchedulerStats


def _samples(m: FrontendMetrics) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(m.render().decode()) for s in fam.samples}


def test_1_2_5_buckets_stop_at_max_model_len():
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(4096)[-1] == 2000


def test_cache_config_info_carries_block_size_and_num_blocks():
    m = FrontendMetrics("tiny", max_model_len=512,
                        cache_info={"block_size": 16, "num_gpu_blocks": 1234})
    labels = [dict(k[1]) for k in _samples(m) if k[0] == "vllm:cache_config_info"]
    assert labels == [{"block_size": "16", "num_gpu_blocks": "1234", "engine": "0"}]


def test_old_names_and_time_per_output_token():
    m = FrontendMetrics("tiny", max_model_len=512)
    m.record_step(SchedulerStats(num_running_reqs=1, num_waiting_reqs=0, kv_cache_usage=0.25,
                                 prefix_cache_queries=10, prefix_cache_hits=4), now=1.0)
    state = types.SimpleNamespace(prompt_len=3, num_output_tokens=5, arrival=0.0, queue_time=0.1,
                                  first_token_time=1.0, last_token_time=3.0, itls=[],
                                  params=types.SimpleNamespace(max_tokens=100))
    m.record_finished(state, "stop", now=3.0)
    m.record_params_n(2)
    s = _samples(m)
    lab = (("engine", "0"), ("model_name", "tiny"))
    assert s[("vllm:gpu_cache_usage_perc", lab)] == 0.25
    assert s[("vllm:gpu_prefix_cache_queries_total", lab)] == 10
    assert s[("vllm:gpu_prefix_cache_hits_total", lab)] == 4
    assert s[("vllm:request_time_per_output_token_seconds_sum", lab)] == 0.5
    assert s[("vllm:request_params_max_tokens_sum", lab)] == 100
    assert s[("vllm:request_params_n_sum", lab)] == 2
    assert s[("vllm:request_params_n_bucket", (*lab[:1], ("le", "2.0"), *lab[1:]))] == 1
    buckets = [dict(k[1])["le"] for k in s if k[0] == "vllm:request_prompt_tokens_bucket"]
    assert buckets[-2:] == ["500.0", "+Inf"]
