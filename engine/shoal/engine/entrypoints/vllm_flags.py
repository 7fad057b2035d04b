"""Every flag of `vllm serve` (vLLM 0.32) and what `shoal serve` does with it: one table.

Three answers, by the project's rule ("a flag that would change the answer and is not
implemented is refused, naming it; one that cannot change the answer is accepted"):
- HONOURED: serve_flags.py defines it with vLLM's meaning;
- NO_EFFECT: accepted; when set, the reason is logged once at start-up;
- REFUSED: accepted at the values that mean "off" (vLLM's default, `--no-...`); any other value
  exits 2 with a termination message naming the flag and why.
A NO_EFFECT or REFUSED flag takes vLLM's shape here (`--x`/`--no-x`, a value, several values)
so a vLLM command line parses. tests/serving/test_vllm_flags.py compares this table with the
flag set of vLLM 0.32's own parser, and docs/serving.md carries `markdown_table()`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

HONOURED, NO_EFFECT, REFUSED = "honoured", "accepted, no effect", "refused"


@dataclass(frozen=True)
class Flag:
    name: str  # vLLM's option string (the first long one)
    kind: str
    reason: str
    aliases: tuple[str, ...] = ()
    shape: str = "value"  # "bool" (--x / --no-x), "true" (store_true), "value", "values"
    off: tuple[str, ...] = ()  # REFUSED: the values accepted as "off" (besides unset, --no-x)

    @property
    def dest(self) -> str:
        return self.name[2:].replace("-", "_")


def _spec(kind: str, reason: str, *specs: str) -> list[Flag]:
    """'--name|-alias:shape=off1,off2' -> Flag (shape and off are optional)."""
    flags = []
    for spec in specs:
        spec, _, off = spec.partition("=")
        spec, _, shape = spec.partition(":")
        name, *aliases = spec.split("|")
        flags.append(Flag(name, kind, reason, tuple(aliases), shape or "value",
                          tuple(off.split(",")) if off else ()))
    return flags


def _honoured(reason: str, *specs: str) -> list[Flag]:
    return _spec(HONOURED, reason, *specs)


def _no_effect(reason: str, *specs: str) -> list[Flag]:
    return _spec(NO_EFFECT, reason, *specs)


def _refused(reason: str, *specs: str) -> list[Flag]:
    return _spec(REFUSED, reason, *specs)


# Reasons, said once each.
EAGER = "nothing is captured or compiled: shoal runs the model eagerly with its own kernels"
KERNELS = "a kernel or backend choice of vLLM's; shoal has its own kernels (same answers)"
GPU_RUNTIME = "a CUDA/NCCL runtime setting of vLLM's; shoal's runtime has no such knob"
TEXT_ONLY = "multimodal input: shoal serves text-only models, so this applies to nothing"
MAMBA = "Mamba/SSM state: shoal serves transformer models, which have none"
MOE = "expert (MoE) layers: shoal serves dense models, which have none"
LOGGING = "logging or tracing of vLLM's; shoal logs its own start-up, errors and stats"
METRICS = "an optional vLLM metric; shoal's /metrics is docs/serving.md's set"
SCHED_TUNING = "a scheduling knob shoal's scheduler does not have; it cannot change an answer"
SLEEP = "sleep mode (/sleep, /wake_up) is not served; the flag only enables those endpoints"
NO_ENDPOINT = "enables an endpoint or service shoal does not serve (those paths answer 404)"
DP = ("data parallelism: the operator runs replicas as separate pods; one `shoal serve` is "
      "one replica")
DP_ONLY = "only with --data-parallel-size > 1, which is refused"
LORA_ONLY = "a LoRA setting shoal has no counterpart for; it cannot change an answer"
SPEC = "speculative decoding is not implemented"
QUANT = "quantized weights are not implemented (bfloat16, float16 and float32 only)"
CP = "context parallelism is not implemented; shoal splits a model with --tensor-parallel-size"
OFFLOAD = "weight and KV offloading are not implemented"
KV_TRANSFER = "KV transfer (disaggregated prefill, LMCache) is not implemented"
CHANGES_ANSWER = "changes what the model computes or returns, and is not implemented"
OTHER_API = "another API server mode of vLLM's (gRPC, several API processes) is not implemented"

FLAGS: tuple[Flag, ...] = tuple(
    # ---- HTTP and the API server
    _honoured("as vLLM", "--log-level", "--host", "--port", "--api-key:values",
              "--served-model-name:values",
              "--root-path", "--allowed-origins", "--allowed-methods", "--allowed-headers",
              "--allow-credentials:bool", "--ssl-keyfile", "--ssl-certfile", "--ssl-ca-certs",
              "--ssl-cert-reqs", "--enable-request-id-headers:bool", "--uvicorn-log-level",
              "--disable-uvicorn-access-log:bool", "--headless:true")
    + _honoured("as vLLM; the model's own template by default", "--chat-template")
    + _honoured("as vLLM: the HTTP/1.1 server's limit", "--h11-max-incomplete-event-size")
    + _no_effect("uvicorn's own header limit applies", "--h11-max-header-count")
    + _no_effect("FastAPI's /docs pages are not served either way", "--disable-fastapi-docs:bool",
                 "--enable-offline-docs:bool")
    + _no_effect("shoal logs no access lines but errors", "--disable-access-log-for-endpoints")
    + _no_effect("certificates are read once at start-up; restart the pod to rotate them",
                 "--enable-ssl-refresh:bool")
    + _refused("a server-side choice of TLS ciphers is not implemented (Python's defaults)",
               "--ssl-ciphers")
    + _refused("user middleware is not loaded", "--middleware")
    + _refused("serving on a Unix socket is not implemented", "--uds")
    + _refused(OTHER_API, "--api-server-count|-asc=1", "--grpc:true", "--grpc-port")
    + _refused("a YAML file of flags is not read; pass the flags on the command line",
               "--config")
    # ---- chat and the OpenAI layer
    + _no_effect("messages are rendered by the model's chat template; content parts are handled "
                 "per docs/serving.md", "--chat-template-content-format")
    + _refused("a request's own chat_template is not accepted either way",
               "--trust-request-chat-template:bool")
    + _no_effect(TEXT_ONLY, "--trust-request-mm-kwargs:bool")
    + _refused(CHANGES_ANSWER, "--default-chat-template-kwargs", "--response-role=assistant",
               "--exclude-tools-when-tool-choice-none:bool",
               "--tool-server", "--tokens-only:bool", "--enable-force-include-usage:bool",
               "--logits-processors:values",
               "--override-generation-config={}", "--logprobs-mode=raw_logprobs",
               "--return-sampling-mask:bool", "--enable-prompt-embeds:bool",
               "--skip-tokenizer-init:bool", "--io-processor-plugin",
               "--enable-return-routed-experts:bool", "--aux-output-config",
               "--structured-outputs-config", "--reasoning-config", "--watermark-config",
               "--use-fp64-gumbel:bool")
    + _honoured("as vLLM: usage.prompt_tokens_details.cached_tokens, the prompt tokens served "
                "from the prefix cache", "--enable-prompt-tokens-details:bool")
    + _honoured("as vLLM: logprob tokens as 'token_id:{id}' (completions and chat; a request's "
                "return_tokens_as_token_ids wins)", "--return-tokens-as-token-ids:bool")
    + _honoured("as vLLM, for the parsers docs/serving.md lists (others exit 2 naming them)",
                "--enable-auto-tool-choice:bool")
    + _honoured("as vLLM: hermes, llama3_json, pythonic, qwen3_coder (others exit 2 naming "
                "them)", "--tool-call-parser")
    + _refused("tool calls are found by --tool-call-parser; a plugin file is not loaded",
               "--tool-parser-plugin=")
    + _no_effect("shoal closes tool-argument grammars to the declared properties "
                 "(docs/serving.md); the level cannot be chosen", "--tool-strict-level")
    + _honoured("as vLLM, for deepseek_r1 and qwen3 (others exit 2 naming them)",
                "--reasoning-parser")
    + _refused("reasoning is split by --reasoning-parser; a plugin file is not loaded",
               "--reasoning-parser-plugin=")
    + _no_effect("Cohere's and Anthropic's APIs are not served (those paths answer 404)",
                 "--cohere-is-reasoning-model:bool", "--cohere-format",
                 "--anthropic-disabled-thinking-effort")
    + _no_effect(NO_ENDPOINT, "--enable-tokenizer-info-endpoint:bool",
                 "--enable-server-load-tracking:bool", "--enable-scale-out:bool",
                 "--fingerprint-mode", "--fingerprint-value")
    + _no_effect("SSE comments that keep idle streams open are not sent; streams carry tokens "
                 "as they come", "--sse-keep-alive-interval")
    + _no_effect(LOGGING, "--max-log-len", "--enable-log-outputs:bool", "--enable-log-deltas:bool",
                 "--log-error-stack:bool", "--enable-log-requests:bool", "--disable-log-stats:true",
                 "--aggregate-engine-logging:true", "--logging-config", "--log-config-file",
                 "--otlp-traces-endpoint", "--collect-detailed-traces:values",
                 "--enable-logging-iteration-details:bool", "--jit-monitor-mode",
                 "--jit-monitor-verbose:bool", "--enable-layerwise-nvtx-tracing:bool",
                 "--profiler-config", "--enable-trace-replay:bool")
    + _no_effect(METRICS, "--enable-per-request-metrics:bool", "--show-hidden-metrics-for-version",
                 "--per-request-spec-decode-metrics", "--kv-cache-metrics:bool",
                 "--kv-cache-metrics-sample", "--custom-histogram-buckets",
                 "--cudagraph-metrics:bool", "--enable-mfu-metrics:bool")
    # ---- the model
    + _honoured("as vLLM: the positional model wins over --model", "--model")
    + _honoured("as vLLM; half = float16, float = float32", "--dtype")
    + _honoured("as vLLM, with k/m/g/t (powers of 10) and K/M/G/T (of 2) suffixes; "
                "-1 or auto = the model's own", "--max-model-len")
    + _honoured("as vLLM", "--seed", "--generation-config", "--max-logprobs",
                "--shutdown-timeout", "--performance-mode")
    + _honoured("accepted; refused when the model's config.json names remote code (auto_map): "
                "shoal runs its own model classes only", "--trust-remote-code:bool")
    + _refused(QUANT, "--quantization|-q", "--quantization-config",
               "--allow-deprecated-quantization:bool")
    + _refused("another tokenizer mode or config path than the model's own is not implemented",
               "--tokenizer-mode=auto,hf", "--hf-config-path")
    + _honoured("as vLLM: a local directory, else a hub id resolved as the model is (the chat "
                "template comes with it); --tokenizer-revision defaults to --revision",
                "--tokenizer", "--tokenizer-revision")
    + _honoured("as vLLM: a hub id's branch, tag or commit (default main), from the cache or "
                "downloaded; a local directory is taken as it is", "--revision")
    + _no_effect("remote code is never run (a model that names it is refused, see "
                 "--trust-remote-code), so its revision applies to nothing", "--code-revision")
    + _refused("another model class or runner than the text generator is not implemented",
               "--runner=auto,generate", "--convert=auto,none", "--model-impl=auto",
               "--hf-overrides={}", "--model-class-overrides={}", "--pooler-config",
               "--config-format=auto,hf", "--language-model-only:bool", "--diffusion-config|-dc",
               "--engram-config", "--enable-flash-late-interaction:bool",
               "--disable-sliding-window:bool")
    + _refused("weights are loaded from the model directory's safetensors only",
               "--load-format=auto,safetensors", "--model-loader-extra-config={}",
               "--pt-load-map-location=cpu", "--safetensors-load-strategy")
    + _honoured("as vLLM: a hub id is resolved in this Hugging Face cache (snapshot_download's "
                "cache_dir; default HF_HUB_CACHE, HF_HOME/hub); a local directory needs none",
                "--download-dir")
    + _honoured("as vLLM: the hub token for a download (default HF_TOKEN, the stored login)",
                "--hf-token")
    + _honoured("as vLLM: files of a hub id not downloaded (default original/**/*)",
                "--ignore-patterns:values")
    + _no_effect("a progress bar of vLLM's; shoal logs one line when the weights are loaded",
                 "--use-tqdm-on-load:bool")
    + _no_effect("weights are loaded the one way shoal loads them (same weights)",
                 "--safetensors-prefetch-num-threads", "--safetensors-prefetch-block-size",
                 "--max-parallel-loading-workers", "--renderer-num-workers")
    + _no_effect(TEXT_ONLY, "--allowed-local-media-path", "--allowed-media-domains:values",
                 "--limit-mm-per-prompt", "--enable-mm-embeds:bool", "--media-io-kwargs",
                 "--mm-processor-kwargs", "--mm-processor-cache-gb", "--mm-processor-cache-type",
                 "--mm-hasher-algorithm", "--mm-shm-cache-max-object-size-mb",
                 "--mm-encoder-only:bool", "--mm-encoder-tp-mode", "--mm-encoder-attn-backend",
                 "--mm-encoder-attn-dtype", "--mm-encoder-fp8-scale-path",
                 "--mm-encoder-fp8-scale-save-path", "--mm-encoder-fp8-scale-save-margin",
                 "--interleave-mm-strings:bool", "--skip-mm-profiling:bool",
                 "--video-pruning-rate", "--video-pruning-method", "--mm-tensor-ipc",
                 "--mm-processor-device", "--mm-ipc-gpu-memory-gb",
                 "--mm-device-do-normalize:bool", "--disable-chunked-mm-input:bool",
                 "--ec-transfer-config", "--ec-manager-config")
    # ---- compilation, kernels, runtime
    + _no_effect(EAGER, "--enforce-eager:bool", "--compilation-config|-cc",
                 "--cudagraph-capture-sizes:values", "--max-cudagraph-capture-size",
                 "--optimization-level")
    + _no_effect(KERNELS, "--attention-backend", "--attention-config|-ac", "--kernel-config",
                 "--ir-op-priority", "--linear-backend", "--enable-flashinfer-autotune:bool",
                 "--disable-cascade-attn:bool", "--sparse-indexer-topk-backend",
                 "--gdn-prefill-backend", "--kda-prefill-backend", "--kda-decode-backend")
    + _no_effect(GPU_RUNTIME, "--enable-cumem-allocator:bool", "--enable-nccl-comm-suspend:bool",
                 "--disable-custom-all-reduce:bool", "--distributed-executor-backend",
                 "--ray-workers-use-nsight:bool", "--device-ids", "--distributed-timeout-seconds",
                 "--cpu-distributed-timeout-seconds", "--numa-bind:bool",
                 "--numa-bind-nodes:values", "--numa-bind-cpus:values",
                 "--enable-shm-tensor-arena:bool", "--fail-on-environ-validation:bool",
                 "--additional-config")
    + _refused("custom worker or scheduler classes are not loaded", "--worker-cls=auto",
               "--worker-extension-cls=", "--scheduler-cls")
    + _no_effect(SLEEP, "--enable-sleep-mode:bool", "--sleep-mode-offload-cudagraph:bool",
                 "--sleep-preserve-parameter-names:values")
    + _refused("weight updates over a transfer channel are not implemented",
               "--weight-transfer-config")
    + _refused("engine fault tolerance (in-place recovery) is not implemented; a dead engine "
               "exits the pod, which Kubernetes restarts", "--enable-fault-tolerance:bool",
               "--fault-tolerance-config")
    + _no_effect(MAMBA, "--mamba-backend", "--mamba-ssu-algorithm",
                 "--enable-mamba-cache-stochastic-rounding:bool", "--mamba-cache-philox-rounds",
                 "--mamba-cache-dtype", "--mamba-ssm-cache-dtype", "--mamba-block-size",
                 "--mamba-cache-mode", "--enable-mamba-shared-prefix-checkpoint:bool",
                 "--replayssm-buffer-len", "--use-replayssm:bool")
    # ---- parallelism
    + _honoured("as vLLM", "--tensor-parallel-size|-tp", "--nnodes|-n", "--node-rank|-r",
                "--master-addr", "--master-port")
    + _honoured("as vLLM; only 1 (refused otherwise)", "--pipeline-parallel-size|-pp")
    + _refused(DP, "--data-parallel-size|-dp=1")
    + _no_effect(DP_ONLY, "--data-parallel-rank|-dpn", "--data-parallel-start-rank|-dpr",
                 "--data-parallel-size-local|-dpl", "--data-parallel-address|-dpa",
                 "--data-parallel-rpc-port|-dpp", "--data-parallel-backend|-dpb",
                 "--data-parallel-hybrid-lb|-dph:bool", "--data-parallel-external-lb|-dpe:bool",
                 "--data-parallel-multi-port-external-lb|-dpm:true",
                 "--data-parallel-supervisor-port", "--dp-supervisor-probe-interval-s",
                 "--dp-supervisor-probe-timeout-s", "--dp-supervisor-probe-failure-threshold",
                 "--dp-sync-interval", "--disable-nccl-for-dp-synchronization:bool",
                 "--enable-dbo:bool", "--ubatch-size", "--dbo-decode-token-threshold",
                 "--dbo-prefill-token-threshold", "--enable-batch-sharded-sampling:bool")
    + _refused(CP, "--decode-context-parallel-size|-dcp=1",
               "--prefill-context-parallel-size|-pcp=1",
               "--enable-hc-sp:bool")
    + _no_effect("only with context parallelism, which is refused", "--dcp-comm-backend",
                 "--dcp-q-replicate:bool", "--dcp-kv-cache-interleave-size",
                 "--cp-kv-cache-interleave-size")
    + _no_effect(MOE, "--enable-expert-parallel|-ep:bool", "--enable-ep-weight-filter:bool",
                 "--all2all-backend", "--enable-elastic-ep:bool", "--elastic-ep-max-dp-size",
                 "--enable-eplb:bool", "--eplb-config", "--expert-placement-strategy",
                 "--moe-backend", "--enable-mixed-moe-lora-format:bool",
                 "--enable-moe-shared-loras:bool")
    # ---- KV cache
    + _honoured("as vLLM", "--block-size", "--enable-prefix-caching:bool",
                "--kv-cache-memory-bytes", "--num-gpu-blocks-override")
    + _honoured("auto = the model's dtype; bfloat16/float16/float32 when it is --dtype's; fp8 "
                "refused (not implemented)", "--kv-cache-dtype")
    + _honoured("as vLLM on CUDA: the share of the device's memory for the weights, a profile "
                "run's peak and the KV cache (--kv-cache-memory-bytes wins); on the CPU "
                "accepted, no effect (logged): the budget is --kv-cache-memory-bytes, else "
                "VLLM_CPU_KVCACHE_SPACE", "--gpu-memory-utilization|--device-memory-utilization")
    + _no_effect("prefix blocks are matched by shoal's own hashes (same reuse)",
                 "--prefix-caching-hash-algo", "--prefix-match-unit")
    + _no_effect(SCHED_TUNING, "--prefix-cache-retention-interval",
                 "--kv-sharing-fast-prefill:bool",
                 "--swa-bounded-replay:bool", "--disable-hybrid-kv-cache-manager:bool",
                 "--kv-cache-dtype-skip-layers:values")
    + _refused(OFFLOAD, "--kv-offloading-size", "--kv-offloading-backend=native",
               "--offload-backend=auto", "--cpu-offload-gb=0", "--cpu-offload-params:values",
               "--offload-group-size=0", "--offload-num-in-group=1", "--offload-prefetch-step=1",
               "--offload-params:values")
    + _refused(KV_TRANSFER, "--kv-transfer-config")
    + _honoured("as vLLM (JSON KVEventsConfig): ZeroMQ PUB of vLLM's KVEventBatch (BlockStored, "
                "BlockRemoved, AllBlocksCleared) and the replay socket; publisher zmq or null; "
                "an inproc:// or tcp://*:0 endpoint refused (docs/engine.md, \"KV cache "
                "events\")", "--kv-events-config")
    # ---- LoRA and speculative decoding
    + _honoured("as vLLM: PEFT adapters on the attention and MLP projections, several adapters "
                "and the base in one batch (docs/engine.md, \"LoRA adapters\"); with "
                "--tensor-parallel-size > 1 refused (A and B are not sharded)",
                "--enable-lora:bool")
    + _honoured("as vLLM: name=path or JSON {\"name\", \"path\", \"base_model_name\"}; each is "
                "read and checked at start-up (a failure exits 2 naming it)",
                "--lora-modules:values")
    + _honoured("as vLLM: device slots (default 1), the largest rank (default 16), host copies "
                "(default --max-loras)", "--max-loras", "--max-lora-rank", "--max-cpu-loras")
    + _no_effect(TEXT_ONLY, "--enable-tower-connector-lora:bool", "--default-mm-loras")
    + _no_effect("sharding of LoRA weights under tensor parallelism, which --enable-lora "
                 "refuses", "--fully-sharded-loras:bool")
    + _no_effect(EAGER, "--specialize-active-lora:bool")
    + _no_effect("classification heads: shoal serves text generation only",
                 "--max-lora-cls-labels")
    + _refused("the LoRA update is computed in float32 (PEFT's autocast_adapter_dtype); another "
               "dtype is not implemented", "--lora-dtype=auto")
    + _refused("LoRA applies to every module an adapter names (q/k/v/o, gate/up/down); a "
               "server-side restriction is not implemented", "--lora-target-modules:values")
    + _refused(SPEC, "--speculative-config|-sc", "--spec-method", "--spec-model", "--spec-tokens")
    # ---- scheduling
    + _honoured("as vLLM", "--max-num-seqs", "--max-num-batched-tokens")
    + _honoured("as vLLM: fcfs, or priority (the request's `priority`, lower first); under "
                "fcfs a priority other than 0 is a 400", "--scheduling-policy")
    + _honoured("always on: long prompts are chunked by --max-num-batched-tokens; "
                "--no-enable-chunked-prefill is accepted (same answers)",
                "--enable-chunked-prefill:bool")
    + _no_effect(SCHED_TUNING, "--max-num-scheduled-tokens", "--max-num-active-seqs",
                 "--max-num-queued-reqs", "--max-num-queued-tokens",
                 "--long-prefill-token-threshold", "--long-prefill-token-threshold-adaptive:bool",
                 "--scheduler-reserve-full-isl:bool", "--watermark", "--prefill-schedule-interval",
                 "--async-scheduling:bool", "--stream-interval")
)


# Flags of earlier vLLM releases that manifests still carry (not in 0.32's parser).
LEGACY: tuple[Flag, ...] = tuple(
    _no_effect(LOGGING, "--disable-log-requests:true"))


def table() -> dict[str, Flag]:
    return {f.name: f for f in FLAGS + LEGACY}


def _kv_events_config(text: str):
    """--kv-events-config's JSON as vLLM reads it (kv_events_config.py); a bad one exits 2."""
    from shoal.engine.errors import ConfigError
    from shoal.engine.kv_events_config import parse_kv_events_config

    try:
        return parse_kv_events_config(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--kv-events-config")
                                         .lstrip(": ")) from None


# HONOURED flags whose value this module parses (serve_flags.py defines the others).
PARSED_HERE = {"--kv-events-config": _kv_events_config}


def register(parser: argparse.ArgumentParser) -> None:
    """vLLM's shape for each table flag the parser does not define itself (NO_EFFECT, REFUSED,
    and any HONOURED one not implemented in this build, which check() then refuses), and the
    PARSED_HERE flags with their parsers."""
    have = parser._option_string_actions  # noqa: SLF001 - argparse keeps no public view
    group = parser.add_argument_group(
        "other vLLM flags (docs/serving.md, \"vLLM's flags\": accepted with no effect, or refused)")
    for name, parse in PARSED_HERE.items():
        if name not in have:
            parser.add_argument(name, dest=table()[name].dest, type=parse, default=None,
                                help=table()[name].reason)
    for flag in table().values():
        if flag.name in have:
            negative = f"--no-{flag.name[2:]}"
            if flag.shape == "bool" and negative not in have:  # vLLM's off form parses too
                group.add_argument(negative, dest=have[flag.name].dest, action="store_false",
                                   help=argparse.SUPPRESS)
            continue
        names = [flag.name, *flag.aliases]
        kw = dict(dest=f"vllm_{flag.dest}", default=None, help=argparse.SUPPRESS)
        if flag.shape == "bool":
            group.add_argument(*names, action=argparse.BooleanOptionalAction, **kw)
        elif flag.shape == "true":
            group.add_argument(*names, action="store_const", const=True, **kw)
        else:
            group.add_argument(*names, nargs="+" if flag.shape == "values" else None, **kw)


def check(args: argparse.Namespace) -> tuple[list[str], str | None]:
    """(the no-effect notes to log, one a flag set; the first refusal or None) for the flags
    register() added."""
    notes = []
    for flag in table().values():
        value = getattr(args, f"vllm_{flag.dest}", None)
        if value is None or value is False:
            continue
        shown = flag.name if value is True else f"{flag.name} {_show(value)}"
        if flag.kind == NO_EFFECT:
            notes.append(f"{shown}: accepted, no effect: {flag.reason}")
        elif _show(value) not in flag.off:
            why = flag.reason if flag.kind == REFUSED else "not implemented in this build"
            return notes, f"{shown} is not supported: {why}"
    return notes, None


def startup_problem(args: argparse.Namespace, model_config: dict) -> str | None:
    """What the HONOURED flags refuse at some values (the reason names the flag), or None."""
    if args.trust_remote_code and model_config.get("auto_map"):
        return ("--trust-remote-code: this model's config.json names remote code (auto_map: "
                f"{sorted(model_config['auto_map'])}); shoal runs its own model classes only")
    kv = args.kv_cache_dtype
    if kv != "auto" and kv != args.dtype:
        if kv.startswith("fp8"):
            return (f"--kv-cache-dtype {kv} is not supported: an fp8 KV cache is not "
                    "implemented (auto keeps it in the model's dtype)")
        return (f"--kv-cache-dtype {kv} is not supported with --dtype {args.dtype}: the KV "
                f"cache is kept in the model's dtype; pass --dtype {kv} or --kv-cache-dtype auto")
    return None


def _show(value) -> str:
    return " ".join(value) if isinstance(value, list) else str(value)


def markdown_table() -> str:
    """docs/serving.md's flag table: one row per flag, by kind then name."""
    order = {HONOURED: 0, NO_EFFECT: 1, REFUSED: 2}
    rows = ["| flag | shoal serve | why |", "|---|---|---|"]
    for f in sorted(table().values(), key=lambda f: (order[f.kind], f.name)):
        names = ", ".join(f"`{n}`" for n in (f.name, *f.aliases))
        kind = f.kind if not f.off else f"{f.kind} (accepted at {', '.join(map(repr, f.off))})"
        rows.append(f"| {names} | {kind} | {f.reason} |")
    return "\n".join(rows) + "\n"


DOC_BEGIN = "<!-- vllm-flags: generated by `python -m shoal.engine.entrypoints.vllm_flags DOC` -->"
DOC_END = "<!-- vllm-flags: end -->"


def doc_with_table(doc: str) -> str:
    """`doc` with the text between DOC_BEGIN and DOC_END replaced by markdown_table()."""
    head, _, rest = doc.partition(DOC_BEGIN + "\n")
    _, _, tail = rest.partition(DOC_END)
    return f"{head}{DOC_BEGIN}\n{markdown_table()}{DOC_END}{tail}"


if __name__ == "__main__":  # python -m shoal.engine.entrypoints.vllm_flags docs/serving.md
    import sys
    from pathlib import Path

    path = Path(sys.argv[1])
    path.write_text(doc_with_table(path.read_text()))
