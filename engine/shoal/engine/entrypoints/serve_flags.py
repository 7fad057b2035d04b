"""`shoal serve`'s command line: vLLM's flag names, one function per flag group.

A bad flag leaves the termination message (`_Parser.error`) before argparse's exit 2, so the
operator sees it as a config error and does not restart the pod.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from shoal.contract import auth
from shoal.engine.config import PERFORMANCE_MODES
from shoal.engine.core.request_queue import POLICIES
from shoal.engine.entrypoints import vllm_flags
from shoal.engine.entrypoints.reasoning import REASONING_PARSERS
from shoal.engine.generation_config import SOURCES_HELP

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.I)


def parse_bytes(text: str) -> int:
    """'1073741824', '512M', '2GiB', '1.5G' -> bytes (K/M/G/T are powers of 1024, like vLLM)."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2147483648, 512M, 2G)")
    value, unit = float(m.group(1)), m.group(2).lower()
    return int(value * 1024 ** " kmgt".index(unit or " "))


_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")


def human_int_or_auto(text: str) -> int:
    """--max-model-len as vLLM parses it (human_readable_int_or_auto): '32k' = 32,000 (k m g t:
    powers of 10, decimals allowed), '32K' = 32,768 (K M G T: powers of 2, whole numbers
    only), '-1' or 'auto' = -1 (the model's own)."""
    text = text.strip()
    if text == "-1" or text.lower() == "auto":
        return -1
    m = _HUMAN_INT.fullmatch(text)
    if m:
        number, suffix = m.groups()
        if suffix.islower():
            return int(float(number) * 1000 ** "_kmgt".index(suffix))
        if "." in number:
            raise argparse.ArgumentTypeError(
                f"decimals are not allowed with binary suffixes like {suffix}; did you mean "
                f"{number}{suffix.lower()}?")
        return int(number) * 1024 ** "_KMGT".index(suffix)
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a length: {text!r} (e.g. 4096, 32k, 32K)") from None


_NAME = re.compile(r"(?<=--)[^.]*")


def dashed(args: list[str]) -> list[str]:
    """Option names with underscores spelled with dashes, as vLLM's FlexibleArgumentParser
    reads them (`--max_num_batched_tokens 1024` is `--max-num-batched-tokens 1024`; only the
    name, up to a `=` or a `.`, never the value)."""
    out = []
    for arg in args:
        if arg.startswith("--"):
            key, eq, value = arg.partition("=")
            arg = _NAME.sub(lambda m: m.group(0).replace("_", "-"), key, count=1) + eq + value
        out.append(arg)
    return out


class _Parser(argparse.ArgumentParser):
    """argparse that also leaves the termination message: a bad flag is a config error the
    operator must see (and not restart), not an exit 2 with nothing said."""

    def parse_known_args(self, args=None, namespace=None):
        return super().parse_known_args(dashed(sys.argv[1:] if args is None else args),
                                        namespace)

    def error(self, message: str):
        from shoal.contract.termination import Cause, write_termination_message

        write_termination_message(Cause.CONFIG_ERROR, f"{self.prog}: error: {message}",
                                  exit_code=2)
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="shoal serve",
        description="Serve a local Hugging Face causal LM over an OpenAI-compatible HTTP API "
                    "(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics, "
                    "/version, /tokenize, /detokenize). Flag names follow `vllm serve`.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("model", nargs="?", default=None,
                   help="local model directory (config.json, safetensors, tokenizer; `shoal "
                        "make-model DIR` writes one), else a Hugging Face hub id ORG/NAME "
                        "(from the cache, or downloaded); or --model")
    p.add_argument("--model", dest="model_flag", default=None,
                   help="the model, as the positional (which wins if both are given)")
    _http_flags(p.add_argument_group("HTTP"))
    eng = p.add_argument_group("engine")
    _batch_flags(eng)
    _model_flags(eng)
    _hub_flags(p.add_argument_group("Hugging Face hub ids (docs/serving.md, \"Models from the "
                                    "hub\")"))
    _kv_flags(eng)
    _lora_flags(p.add_argument_group("LoRA adapters (docs/engine.md, \"LoRA adapters\")"))
    _parallel_flags(p.add_argument_group(
        "parallelism (docs/serving.md, \"More than one rank\")"))
    p.add_argument("--engine-host", default=None,
                   help="bind the engine sockets on tcp://HOST instead of ipc:// (remote engine)")
    _tool_flags(p.add_argument_group(
        "tool calling (docs/serving.md, \"Structured output and tools\")"))
    p.add_argument("--log-level", default="INFO", type=str.upper,
                   choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"])
    _server_flags(p.add_argument_group("HTTP server (uvicorn), as vLLM"))
    _chat_flags(p.add_argument_group("chat"))
    vllm_flags.register(p)
    return p


def _http_flags(net) -> None:
    net.add_argument("--host", default="0.0.0.0", help="address to listen on")
    net.add_argument("--port", type=int, default=8000, help="port to listen on")
    net.add_argument("--served-model-name", nargs="+", default=None,
                     help="model name(s) clients send as `model`; the first is reported in "
                          "responses (default: the model path)")
    auth.add_api_key_argument(net)


def _batch_flags(eng) -> None:
    eng.add_argument("--max-model-len", type=human_int_or_auto, default=None,
                     help="context length (prompt + output): 4096, 32k (32,000), 32K (32,768); "
                          "default (or -1, auto): the model's own")
    eng.add_argument("--max-num-seqs", type=int, default=None,
                     help="most requests running in one batch (default, vLLM's: 128 per rank on "
                          "the CPU, 256 on a GPU)")
    eng.add_argument("--max-num-batched-tokens", type=int, default=None,
                     help="token budget of one engine step, long prompts are chunked (default, "
                          "vLLM's: 2048 per rank on the CPU, 2048 on a GPU)")
    eng.add_argument("--scheduling-policy", choices=POLICIES, default="fcfs",
                     help="fcfs: requests run in arrival order; priority: by the request's "
                          "`priority` (lower first, then arrival; the largest is preempted first) "
                          "(vLLM's flag)")
    eng.add_argument("--performance-mode", choices=PERFORMANCE_MODES, default="balanced",
                     help="throughput: twice the default seats and token budget, for "
                          "aggregate tokens/s over per-request latency (vLLM's flag)")
    eng.add_argument("--shutdown-timeout", type=float, default=0.0,
                     help="on SIGTERM: 0 = abort in-flight requests (they finish with reason "
                          "'abort'); N > 0 = drain: refuse new requests (503) and finish running "
                          "ones for up to N seconds, then abort the rest")


def _model_flags(eng) -> None:
    eng.add_argument("--dtype", default="auto",
                     choices=["auto", "float32", "bfloat16", "float16", "half", "float"],
                     help="weight/activation/KV dtype; auto = the model's own, but float32 "
                          "checkpoints run in bfloat16 on CUDA and on CPUs with native bf16 "
                          "(as vLLM); half = float16, float = float32")
    eng.add_argument("--trust-remote-code", action=argparse.BooleanOptionalAction,
                     default=False, help="accepted; a model whose config.json names remote "
                                         "code (auto_map) is refused: shoal runs its own classes")
    eng.add_argument("--device", default="auto",
                     help="cpu, cuda, cuda:N or auto (CUDA when torch sees a GPU, else the "
                          "CPU; the start-up line `device: ...` says which and why)")
    eng.add_argument("--seed", type=int, default=0,
                     help="seed of the engine's generator for unseeded sampled requests")
    eng.add_argument("--num-threads", type=int, default=None,
                     help="torch threads of each engine rank (default: the CPUs this process "
                          "may use (affinity, cgroup CPU limit) split over this node's ranks)")
    eng.add_argument("--generation-config", default="auto",
                     help="default sampling values (temperature, top_p, top_k, min_p, penalties, "
                          "max_new_tokens as max_tokens) under a request's own: "
                          f"{SOURCES_HELP} (vLLM's flag)")
    eng.add_argument("--max-logprobs", type=int, default=20,
                     help="most logprobs (alternatives per token) a request's logprobs, "
                          "top_logprobs or prompt_logprobs may ask for")


def _hub_flags(hub) -> None:
    hub.add_argument("--revision", default=None,
                     help="branch, tag or commit of a hub id (default main)")
    hub.add_argument("--download-dir", default=None,
                     help="the Hugging Face cache a hub id is resolved in and downloaded to "
                          "(default: HF_HUB_CACHE, else HF_HOME/hub)")
    hub.add_argument("--hf-token", nargs="?", const=True, default=None,
                     help="hub token for downloads (default: HF_TOKEN, else the stored login; "
                          "alone: the stored login)")
    hub.add_argument("--tokenizer", default=None,
                     help="tokenizer (and chat template) from this directory or hub id instead "
                          "of the model's")
    hub.add_argument("--tokenizer-revision", default=None,
                     help="revision of a hub --tokenizer (default: --revision)")
    hub.add_argument("--ignore-patterns", nargs="+", default=None,
                     help="files of a hub id not to download (default: original/**/*)")


def _kv_flags(eng) -> None:
    eng.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    eng.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                     default=True, help="reuse KV blocks of shared prompt prefixes")
    eng.add_argument("--kv-cache-memory-bytes", type=parse_bytes, default=None,
                     help="KV-cache budget, e.g. 2G (default: $SHOAL_KV_CACHE_SPACE GiB; else "
                          "on the CPU $VLLM_CPU_KVCACHE_SPACE GiB, else 1 GiB; on CUDA "
                          "--gpu-memory-utilization sizes it); wins over the utilization")
    eng.add_argument("--gpu-memory-utilization", "--device-memory-utilization", type=float,
                     default=None,
                     help="CUDA: the share of the device's memory this engine may use for the "
                          "weights, a profile run's peak and the KV cache (default 0.9, "
                          "vLLM's); no effect on the CPU (logged)")
    eng.add_argument("--num-gpu-blocks-override", type=int, default=None,
                     help="use exactly this many KV blocks instead of sizing from the budget")
    eng.add_argument("--kv-cache-dtype", default="auto",
                     help="auto = the model's dtype; bfloat16, float16 or float32 when that is "
                          "--dtype's (the KV cache is kept in the model's dtype); fp8 kinds are "
                          "refused")
    eng.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                     default=None, help="always on: prompts longer than "
                                        "--max-num-batched-tokens are chunked")


def _lora_flags(lora) -> None:
    lora.add_argument("--enable-lora", action=argparse.BooleanOptionalAction, default=False,
                      help="serve PEFT LoRA adapters (a request's `model` names one)")
    lora.add_argument("--lora-modules", nargs="+", default=None,
                      help="adapters served from start-up: name=path, or JSON "
                           "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'")
    lora.add_argument("--max-loras", type=int, default=1,
                      help="adapters on the device at once (one step runs at most this many)")
    lora.add_argument("--max-lora-rank", type=int, default=16,
                      help="the largest adapter rank accepted")
    lora.add_argument("--max-cpu-loras", type=int, default=None,
                      help="adapters kept in host memory (default: --max-loras)")


def _parallel_flags(par) -> None:
    par.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                     help="ranks per model replica; every layer is split over them")
    par.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                     help="pipeline stages (only 1 is implemented)")
    par.add_argument("--nnodes", "-n", type=int, default=1,
                     help="nodes the ranks are spread over (tensor-parallel-size / nnodes each)")
    par.add_argument("--node-rank", "-r", type=int, default=0,
                     help="this node's rank in the group; nodes other than 0 run --headless")
    par.add_argument("--master-addr", default="127.0.0.1",
                     help="node 0's address: torch.distributed, step broadcast, group link")
    par.add_argument("--master-port", type=int, default=29500,
                     help="node 0's torch.distributed port (multi-node; the group link uses "
                          "port + 1)")
    par.add_argument("--headless", action="store_true",
                     help="run this node's workers only (no API server, no scheduler); needs "
                          "--nnodes > 1 and --node-rank > 0")


def _tool_flags(tools) -> None:
    tools.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='allow tool_choice "auto" (the default with tools): the model calls '
                            "tools in its own words, read by --tool-call-parser")
    tools.add_argument("--tool-call-parser",
                       choices=["hermes", "llama3_json", "pythonic", "qwen3_coder"],
                       default=None,
                       help="how tool calls are found in free text under tool_choice \"auto\": "
                            "hermes = <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>"
                            "; llama3_json = {\"name\": ..., \"parameters\": ...}; ... (Llama "
                            "3.1+, after <|python_tag|> or not); pythonic = [f(a=1), g()]; "
                            "qwen3_coder = <tool_call><function=f>"
                            "<parameter=a>1</parameter></function></tool_call>")
    tools.add_argument("--reasoning-parser", choices=list(REASONING_PARSERS), default=None,
                       help="split the model's thinking from its answer: deepseek_r1 or qwen3 "
                            "(<think>...</think>), returned as `reasoning` (vLLM's field)")


def _server_flags(srv) -> None:
    srv.add_argument("--root-path", default=None,
                     help="the path prefix a proxy strips (FastAPI's root_path)")
    srv.add_argument("--allowed-origins", type=json.loads, default=[],
                     help='CORS origins, a JSON list: \'["https://a.example"]\' (none: no CORS)')
    srv.add_argument("--allowed-methods", type=json.loads, default=["*"],
                     help="CORS methods, a JSON list")
    srv.add_argument("--allowed-headers", type=json.loads, default=["*"],
                     help="CORS headers, a JSON list")
    srv.add_argument("--allow-credentials", action=argparse.BooleanOptionalAction, default=False,
                     help="CORS: allow credentials")
    srv.add_argument("--ssl-keyfile", default=None, help="TLS private key file (PEM)")
    srv.add_argument("--ssl-certfile", default=None, help="TLS certificate file (PEM)")
    srv.add_argument("--ssl-ca-certs", default=None,
                     help="CA certificates to verify client certificates with")
    srv.add_argument("--ssl-cert-reqs", type=int, default=0,
                     help="client certificates: 0 none, 1 optional, 2 required (Python's ssl)")
    srv.add_argument("--enable-request-id-headers", action=argparse.BooleanOptionalAction,
                     default=False, help="answer with an X-Request-Id header: the request's "
                                         "own, else a new one")
    srv.add_argument("--uvicorn-log-level", default="warning",
                     choices=["critical", "error", "warning", "info", "debug", "trace"],
                     help="uvicorn's log level (shoal's default: warning)")
    srv.add_argument("--disable-uvicorn-access-log", action=argparse.BooleanOptionalAction,
                     default=None, help="no access-log lines (shoal writes none unless "
                                        "--uvicorn-log-level is info or lower)")
    srv.add_argument("--h11-max-incomplete-event-size", type=int, default=4194304,
                     help="most bytes of an incomplete HTTP request (headers)")


def _chat_flags(chat) -> None:
    chat.add_argument("--return-tokens-as-token-ids", action=argparse.BooleanOptionalAction,
                      default=False, help="logprob tokens as 'token_id:{id}' strings (a "
                                          "request's return_tokens_as_token_ids wins)")
    chat.add_argument("--chat-template", default=None,
                      help="a Jinja chat template instead of the model's: a file, or the "
                           "template itself (as vLLM: text with {, } or a newline)")
    chat.add_argument("--enable-prompt-tokens-details", action=argparse.BooleanOptionalAction,
                      default=False, help="usage.prompt_tokens_details.cached_tokens: the "
                                          "prompt tokens served from the prefix cache")
