"""Which of vLLM's root-cause lines are permanent faults, as a table with its own tests.

Applied to what vLLM said first (shoal.supervisor.vllm_log: each process's first exception, its
ERROR lines, argparse's `error:` line), never to the whole log. Each rule carries texts copied
from real vLLM 0.32.0 output that it must match, and look-alikes it must not
(tests/supervisor/test_rules.py; the logs are in tests/supervisor/data/). A permanent cause
needs a rule only that fault produces; anything unmatched stays transient.
"""

from __future__ import annotations

import re

from shoal.contract.termination import Cause, TextRule

# The texts are lines of tests/supervisor/data/*.err|out as the log memory keeps them (the
# Supported-architectures list cut at vllm_log.MAX_LINE).
MAX_LEN = ("Value error, User-specified max_model_len (100000) is greater than the derived "
           "max_model_len (max_position_embeddings=2048.0 or model_max_length=None in model's "
           "config.json). To allow overriding this maximum, set the env var "
           "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1.")
UNKNOWN_ARCH = ("Value error, Model architectures ['NoSuchForCausalLM'] are not supported for "
                "now. Supported architectures: dict_keys(['AfmoeForCausalLM', "
                "'ApertusForCausalLM'")
NO_MODEL = ("huggingface_hub.errors.HFValidationError: Repo id must be in the form 'repo_name' "
            "or 'namespace/repo_name': '/nonexistent/model'. Use `repo_type` argument if needed.")
VALIDATION = "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig"
USAGE = ("vllm: error: unrecognized arguments: --no-such-flag",
         "vllm serve: error: argument --dtype: invalid choice: 'fp7' (choose from 'auto', "
         "'bfloat16', 'float', 'float16', 'float32', 'half')")
# vllm/v1/core/kv_cache_utils.py's two refusals (0.32.0); the first is e4-kv-bytes-1's, the
# second as the source words it.
KV_CACHE = ("ValueError: No available memory for the cache blocks. Try increasing "
            "`gpu_memory_utilization` when initializing the engine (this flag also controls CPU "
            "memory reservation on the CPU backend, despite its name). See "
            "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.",
            "ValueError: To serve at least one request with the model's max seq len (256), "
            "(0.01 GiB KV cache is needed, which is larger than the available KV cache memory "
            "(0.0 GiB). Try increasing `gpu_memory_utilization`")
# vllm/v1/worker/cpu_worker.py: a KV cache larger than the node's memory (e3-kv-space-too-big).
CPU_KV = ("ValueError: Available memory on node 0 (21.4/23.54 GiB) on kv cache allocation is less "
          "than requested memory for kv (1000.0 GiB). Decrease --kv-cache-memory-bytes, "
          "VLLM_CPU_KVCACHE_SPACE, or reduce CPU memory used by other processes.",)
OOM = ("RuntimeError: [enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
       "allocate memory: you tried to allocate 70368744177664 bytes. Error code 12 (Cannot "
       "allocate memory)",)
# vllm/envs.py on a pod whose namespace has a Service named `vllm`: the kubelet's service links
# set VLLM_PORT=tcp://IP:PORT (seen on the dev cluster's pods, e2e; the operator now sets
# enableServiceLinks: false on engine pods, but a user's env can still set it).
VLLM_PORT_URI = ("ValueError: VLLM_PORT 'tcp://10.96.144.178:8000' appears to be a URI. This may "
                 "be caused by a Kubernetes service discovery issue,check the warning in: "
                 "https://docs.vllm.ai/en/latest/configuration/env_vars.html",)
# Real lines of the same logs that name no fault.
ULIMIT = ("Found ulimit of 20000 and failed to automatically increase with error current limit "
          "exceeds maximum limit. This can cause fd limit errors like `OSError: [Errno 24] Too "
          "many open files`. Consider increasing with ulimit -n")
ARCH_OK = "Resolved architecture: LlamaForCausalLM"
MODEL_LEN_OK = "Using max model len 256"
KV_CACHE_OK = ("CPU KV cache size: 524,288 tokens, Maximum concurrency for 256 tokens per "
               "request: 2048.00x",
               "Explicitly set (1.0/19.59) GiB for KV cache on node 0.")
CONSEQUENCE = ("RuntimeError: Engine core initialization failed. See root cause above. Failed "
               "core proc(s): {}")

RULES: tuple[TextRule, ...] = (
    TextRule(re.compile(r"User-specified max_model_len \(\d+\) is greater than the derived "
                        r"max_model_len"),
             Cause.CONFIG_ERROR, (MAX_LEN,), (MODEL_LEN_OK, CONSEQUENCE)),
    TextRule(re.compile(r"Model architectures \[.*\] are not supported for now|"
                        r"Model architecture \w+ is not supported in-tree anymore"),
             Cause.CONFIG_ERROR, (UNKNOWN_ARCH,), (ARCH_OK,)),
    TextRule(re.compile(r"No available memory for the cache blocks|"
                        r"To serve at least one request with the model's max seq len \(\d+\), "
                        r"\([\d.]+ GiB KV cache is needed, which is larger than the available"),
             Cause.CONFIG_ERROR, KV_CACHE, KV_CACHE_OK),
    TextRule(re.compile(r"on kv cache allocation is less than requested memory for kv"),
             Cause.CONFIG_ERROR, CPU_KV, (*KV_CACHE_OK, ULIMIT)),
    TextRule(re.compile(r"Repo id must be in the form 'repo_name' or 'namespace/repo_name'|"
                        r"Invalid repository ID or local directory specified|"
                        r"is not a local folder and is not a valid model identifier|"
                        r"Repository Not Found for url"),
             Cause.MODEL_NOT_FOUND, (NO_MODEL,), (ULIMIT, ARCH_OK)),
    TextRule(re.compile(r"VLLM_PORT '[^']*' (appears to be a URI|must be a valid integer)"),
             Cause.CONFIG_ERROR, VLLM_PORT_URI, (ULIMIT, CONSEQUENCE)),
    # Generic ones last: a more specific cause above wins.
    TextRule(re.compile(r"(?m)^[\w. /-]+: error: (unrecognized arguments|argument |"
                        r"the following arguments are required)|"
                        r"validation errors? for \w*Config\b"),
             Cause.CONFIG_ERROR, (VALIDATION, *USAGE), (ULIMIT, CONSEQUENCE)),
    TextRule(re.compile(r"OutOfMemoryError|out of memory|Cannot allocate memory", re.I),
             Cause.OUT_OF_MEMORY, OOM, (ULIMIT, KV_CACHE_OK[0])),
)

def classify(texts: list[str]) -> Cause | None:
    """The first rule that matches any of `texts` (root-cause lines), or None."""
    for rule in RULES:
        if any(rule.pattern.search(text) for text in texts):
            return rule.cause
    return None
