"""EngineConfig: the one validated, immutable configuration object of an engine.

Every bad value raises ConfigError (a ValueError) saying what to change, at construction,
before any model is loaded. Values the engine derives (the context length from the model, the
KV memory budget from the environment) are resolved here too, so the object that is passed
around is complete.
This module imports neither torch nor transformers: the frontend process builds and checks a
config without them.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from shoal.engine.errors import ConfigError, ModelNotFoundError
from shoal.engine.kv_events_config import KVEventsConfig, parse_kv_events_config
from shoal.engine.lora.config import LoRAConfig

GiB = 1 << 30
# The KV cache budget in GiB when no flag is given: Shoal's own, then vLLM's CPU variable (read
# on the CPU only, as vLLM does), so a vLLM manifest that sizes the cache by env var is honoured.
KV_CACHE_SPACE_ENV = "SHOAL_KV_CACHE_SPACE"
VLLM_KV_CACHE_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"
DEFAULT_CPU_KV_CACHE_GIB = 1.0
DTYPES = ("auto", "float32", "bfloat16", "float16")


PERFORMANCE_MODES = ("balanced", "throughput")


def serving_batch_defaults(device: str, world_size: int,
                           performance_mode: str = "balanced") -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) for an API server given neither: vLLM's own
    (vllm/engine/arg_utils.py, get_batch_defaults) so a server answers as a vLLM user expects.

    On the CPU vLLM's API server seats 128 requests and budgets 2,048 tokens a step, per rank
    of the tensor-parallel group: fewer seats than a GPU's, which keeps inter-token latency
    down on cores that the frontend shares (benchmarks/README.md, "One OpenMP team and vLLM's
    seats"). Elsewhere 256 and 2,048, vLLM's figures for GPUs under 70 GiB (vLLM seats 1,024
    on larger ones: pass --max-num-seqs there). `throughput` doubles both, as vLLM's
    --performance-mode does."""
    if device == "cpu":
        seats, tokens = 128 * world_size, 2048 * world_size
    else:
        seats, tokens = 256, 2048
    if performance_mode not in PERFORMANCE_MODES:
        _fail(f"performance_mode must be one of {list(PERFORMANCE_MODES)}, got "
              f"{performance_mode!r}.")
    if performance_mode == "throughput":
        seats, tokens = 2 * seats, 2 * tokens
    return seats, tokens


def _fail(msg: str) -> None:
    raise ConfigError(msg)


def read_model_config(model: str) -> dict:
    """config.json of a local model directory, or a ModelNotFoundError that says what is wrong."""
    path = Path(model)
    if not path.is_dir():
        raise ModelNotFoundError(f"model path {model!r} is not a directory; pass a local Hugging "
                                 "Face model directory (make one with `shoal make-model DIR`).")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelNotFoundError(f"model directory {model!r} has no config.json; is it a Hugging "
                                 "Face model directory? (`shoal make-model DIR` writes one).")
    try:
        return json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{cfg_file} is not valid JSON: {exc}") from None


def check_model_readable(model: str) -> None:
    """PermissionError naming the files of a model directory this process cannot read.

    Loaders report an unreadable file as "No such file or directory" (safetensors does), which
    reads as a missing model, a permanent fault; an unreadable one is a start-up fault that a
    fixed volume cures, and it must say so."""
    path = Path(model)
    if not path.is_dir():
        return
    unreadable = sorted(p.name for p in path.iterdir() if p.is_file() and not os.access(p, os.R_OK))
    if unreadable:
        raise PermissionError(f"model files {unreadable} in {model} exist but are not readable by "
                              f"this process (uid {os.getuid()}); make them readable by it (e.g. "
                              "chmod a+r; `shoal make-model` writes them so)")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """All knobs of one engine. Construct it with keyword arguments; it validates itself."""

    model: str
    tokenizer: str | None = None  # a local directory; None = the model's own
    dtype: str = "auto"  # auto = the model's own, float32 checkpoints in bf16 where native (vLLM's)
    device: str = "cpu"  # "cpu", "cuda", "cuda:N" or "auto" (cuda when available)
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    max_num_seqs: int = 256  # seats: requests running at once
    max_num_batched_tokens: int = 2048  # token budget of one step
    block_size: int = 16  # tokens per KV block
    enable_prefix_caching: bool = True
    # KV budget in bytes. None: $SHOAL_KV_CACHE_SPACE GiB; else on the CPU vLLM's
    # $VLLM_CPU_KVCACHE_SPACE GiB, else 1 GiB; on CUDA gpu_memory_utilization sizes it.
    kv_cache_memory_bytes: int | None = None
    # CUDA only (vLLM's): the share of the device's total memory this engine may use: weights,
    # the profile run's peak and the KV cache (worker/kv_sizing.py).
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None  # override the sized block count (tests force preemption)
    seed: int = 0  # seeds the global generator used by unseeded sampled requests
    num_threads: int | None = None  # torch intra-op threads; None = torch's default
    enable_chunked_prefill: bool = True  # off: a prompt must fit the token budget in one step
    # Most alternatives a request's logprobs / prompt_logprobs may ask for (vLLM's default, 20).
    max_logprobs: int = 20
    # Parallelism (vLLM's flags). T ranks split every layer (tensor parallelism); the ranks are
    # spread evenly over `nnodes` nodes, node 0 runs the EngineCore and ranks 0..T/nnodes-1.
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"  # node 0's address: torch.distributed and the step broadcast
    master_port: int = 29500  # torch.distributed's store; the group's control link uses +1
    # vLLM's --kv-events-config (kv_events_config.py): a KVEventsConfig, or its JSON text or
    # dict (normalised here). None or disabled: the engine builds no events at all.
    kv_events_config: KVEventsConfig | None = None
    # --enable-lora (lora/config.py): adapter slots and the largest rank; None = no LoRA.
    lora_config: LoRAConfig | None = None
    architectures: tuple[str, ...] = ()  # derived from config.json
    model_max_len: int = 0  # derived: the model's own context length

    def __post_init__(self) -> None:
        hf = read_model_config(self.model)
        archs = tuple(hf.get("architectures") or ())
        if not archs:
            _fail(f"{self.model}/config.json names no 'architectures'; shoal needs a causal LM "
                  "architecture such as LlamaForCausalLM or Qwen2ForCausalLM.")
        # A causal-LM head (transformers names them *ForCausalLM or *LMHeadModel, as GPT-2's);
        # whether shoal serves the model exactly is decided at load by what it uses.
        if not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
            _fail(f"unsupported architecture {list(archs)} in {self.model}: shoal serves "
                  "decoder-only causal LMs (*ForCausalLM, *LMHeadModel), e.g. LlamaForCausalLM.")
        # GPT-2's family names its context length n_positions.
        model_len = int(hf.get("max_position_embeddings") or hf.get("n_positions") or 0)
        object.__setattr__(self, "architectures", archs)
        object.__setattr__(self, "model_max_len", model_len)
        if self.max_model_len is None:
            if model_len <= 0:
                _fail(f"{self.model}/config.json has no max_position_embeddings; pass "
                      "max_model_len explicitly.")
            object.__setattr__(self, "max_model_len", model_len)
        object.__setattr__(self, "kv_events_config",
                           parse_kv_events_config(self.kv_events_config))
        if isinstance(self.lora_config, dict):  # from the engine process's JSON spec
            object.__setattr__(self, "lora_config", LoRAConfig(**self.lora_config))
        if self.kv_cache_memory_bytes is None:  # on CUDA (or auto) only Shoal's own variable
            object.__setattr__(self, "kv_cache_memory_bytes", cpu_kv_cache_bytes()
                               if self.device == "cpu" else _kv_bytes_from_env(on_cpu=False))
        self._validate()

    def _validate(self) -> None:
        if self.dtype not in DTYPES:
            _fail(f"dtype must be one of {list(DTYPES)}, got {self.dtype!r}.")
        if not (self.device in ("cpu", "cuda", "auto") or self.device.startswith("cuda:")):
            _fail(f"device must be 'cpu', 'cuda', 'cuda:N' or 'auto', got {self.device!r}.")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                _fail(f"{name} must be at least 1, got {getattr(self, name)}.")
        if self.model_max_len and self.max_model_len > self.model_max_len:
            _fail(f"max_model_len {self.max_model_len} exceeds the model's context length "
                  f"{self.model_max_len} (max_position_embeddings); lower it.")
        if self.block_size & (self.block_size - 1):
            _fail(f"block_size must be a power of two, got {self.block_size}.")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            _fail(f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) "
                  f"must be at least max_model_len ({self.max_model_len}); raise it or enable "
                  "chunked prefill.")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            _fail(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            _fail(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            _fail(f"num_kv_blocks must be at least 2 (block 0 is reserved), "
                  f"got {self.num_kv_blocks}.")
        if self.num_threads is not None and self.num_threads < 1:
            _fail(f"num_threads must be at least 1, got {self.num_threads}.")
        if self.max_logprobs < 0:
            _fail(f"max_logprobs must be non-negative, got {self.max_logprobs}.")
        self._validate_parallel()

    def _validate_parallel(self) -> None:
        tp, nnodes = self.tensor_parallel_size, self.nnodes
        if tp < 1 or nnodes < 1:
            _fail(f"tensor_parallel_size and nnodes must be at least 1, got {tp} and {nnodes}.")
        if tp % nnodes:
            _fail(f"tensor_parallel_size {tp} does not split evenly over nnodes {nnodes}: "
                  "every node runs the same number of ranks.")
        if not 0 <= self.node_rank < nnodes:
            _fail(f"node_rank {self.node_rank} is outside [0, nnodes {nnodes}).")
        if self.lora_config is not None and tp > 1:
            _fail(f"--enable-lora with --tensor-parallel-size {tp} is not supported: LoRA "
                  "adapters are applied on one rank only (A and B are not sharded); serve "
                  "adapters with --tensor-parallel-size 1.")
        if not 0 < self.master_port < 65535:
            _fail(f"master_port must be in 1..65534 (the control link uses master_port + 1), "
                  f"got {self.master_port}.")

    @property
    def tokenizer_path(self) -> str:
        """Where the tokenizer (and chat template) is read: --tokenizer, else the model."""
        return self.tokenizer or self.model

    @property
    def world_size(self) -> int:
        """Ranks in the group (tensor parallelism only: pipeline parallelism is refused)."""
        return self.tensor_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    def local_ranks(self, node_rank: int | None = None) -> range:
        """The global ranks that run on a node (this node by default)."""
        node = self.node_rank if node_rank is None else node_rank
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)

    def replace(self, **changes) -> EngineConfig:
        """A validated copy with some fields changed (derived fields are recomputed)."""
        changes.setdefault("architectures", ())
        changes.setdefault("model_max_len", 0)
        return dataclasses.replace(self, **changes)


def cpu_kv_cache_bytes() -> int:
    """The CPU's KV budget when no flag gives one: $SHOAL_KV_CACHE_SPACE, else
    $VLLM_CPU_KVCACHE_SPACE (GiB), else 1 GiB."""
    return _kv_bytes_from_env(on_cpu=True) or int(DEFAULT_CPU_KV_CACHE_GIB * GiB)


def _kv_bytes_from_env(on_cpu: bool = True) -> int | None:
    """The first of $SHOAL_KV_CACHE_SPACE and (on the CPU) $VLLM_CPU_KVCACHE_SPACE that is set,
    in GiB, or None. vLLM's 0 means "not set" there, so it does here."""
    names = (KV_CACHE_SPACE_ENV, VLLM_KV_CACHE_SPACE_ENV) if on_cpu else (KV_CACHE_SPACE_ENV,)
    for name in names:
        raw = os.environ.get(name, "").strip()
        if raw == "" or (name == VLLM_KV_CACHE_SPACE_ENV and raw == "0"):
            continue
        try:
            gib = float(raw)
        except ValueError:
            raise ConfigError(f"{name} must be a number of GiB, got {raw!r}.") from None
        if gib <= 0:
            _fail(f"{name} must be positive (GiB), got {raw!r}.")
        return int(gib * GiB)
    return None
