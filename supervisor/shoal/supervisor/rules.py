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

RULES: tuple[TextRule, ...] = (
    TextRule(re.compile(r"User-specified max_model_len \(\d+\) is greater than the derived "
                        r"max_model_len"),
             Cause.CONFIG_ERROR,
             ("Value error, User-specified max_model_len (100000) is greater than the derived "
              "max_model_len (max_position_embeddings=2048.0 or model_max_length=None in "
              "model's config.json). To allow overriding this maximum, set the env var "
              "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1.",),
             ("ValueError: This model's maximum context length is 2048 tokens. However, you "
              "requested 3000 tokens",)),
    TextRule(re.compile(r"Model architectures \[.*\] are not supported for now|"
                        r"Model architecture \w+ is not supported in-tree anymore"),
             Cause.CONFIG_ERROR,
             ("Value error, Model architectures ['NoSuchForCausalLM'] are not supported for "
              "now. Supported architectures: dict_keys(['AfmoeForCausalLM'])",),
             ("WARNING: Model architecture LlamaForCausalLM is partially supported",)),
    TextRule(re.compile(r"No available memory for the cache blocks|"
                        r"To serve at least one request with the model's max seq len \(\d+\), "
                        r"\([\d.]+ GiB KV cache is needed, which is larger than the available"),
             Cause.CONFIG_ERROR,
             ("ValueError: No available memory for the cache blocks. Try increasing "
              "`gpu_memory_utilization` when initializing the engine",
              "ValueError: To serve at least one request with the model's max seq len (2048), "
              "(0.06 GiB KV cache is needed, which is larger than the available KV cache "
              "memory (0.0 GiB). Try increasing `gpu_memory_utilization`"),
             ("INFO: # cpu blocks: 7281, GPU KV cache size: 116,496 tokens",
              "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB")),
    TextRule(re.compile(r"(?m)^[\w. /-]+: error: (unrecognized arguments|argument |"
                        r"the following arguments are required)|"
                        r"validation errors? for \w*Config\b"),
             Cause.CONFIG_ERROR,
             ("vllm serve: error: unrecognized arguments: --no-such-flag",
              "vllm serve: error: argument --dtype: invalid choice: 'fp7' (choose from auto, "
              "bfloat16, float, float16, float32, half)",
              "pydantic_core._pydantic_core.ValidationError: 1 validation error for "
              "ModelConfig"),
             ("ValueError: max_tokens must be at least 1, got 0",)),
    TextRule(re.compile(r"Invalid repository ID or local directory specified|"
                        r"is not a local folder and is not a valid model identifier|"
                        r"Repository Not Found for url"),
             Cause.MODEL_NOT_FOUND,
             ("ValueError: Invalid repository ID or local directory specified: "
              "'/models/no-such-model'.",
              "OSError: /models/llama is not a local folder and is not a valid model "
              "identifier listed on 'https://huggingface.co/models'"),
             ("FileNotFoundError: [Errno 2] No such file or directory: '/dev/shm/nccl-Xk2b'",)),
    TextRule(re.compile(r"OutOfMemoryError|out of memory|Cannot allocate memory", re.I),
             Cause.OUT_OF_MEMORY,
             ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
              "RuntimeError: [enforce fail at alloc_cpu.cpp:119] err == 0. DefaultCPUAllocator: "
              "can't allocate memory: you tried to allocate 34359738368 bytes. Error code 12 "
              "(Cannot allocate memory)"),
             ("INFO: GPU KV cache usage: 93.0%",)),
)


def classify(texts: list[str]) -> Cause | None:
    """The first rule that matches any of `texts` (root-cause lines), or None."""
    for rule in RULES:
        if any(rule.pattern.search(text) for text in texts):
            return rule.cause
    return None
