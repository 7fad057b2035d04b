"""`shoal serve MODEL`: the OpenAI-compatible server (vLLM's flag names).

Processes: this one (the API server: uvicorn + FastAPI + AsyncLLM, the tokenizer, metrics) and
one EngineCore process it starts (`python -m shoal.engine.core.engine_core_proc`), joined by ZeroMQ.

Signals: the first SIGTERM/SIGINT stops admissions (503, /health 503) and forwards SIGTERM to the
engine, which aborts (`--shutdown-timeout 0`) or drains (> 0) what is in flight; the server exits
when the engine has stopped. A second signal exits at once. Exit code: 0 after a requested
shutdown, 1 when the engine died (the root cause is logged and written as the Kubernetes
termination message), 2 for bad flags.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal
import sys
import time

from shoal.engine.config import PERFORMANCE_MODES, serving_batch_defaults

logger = logging.getLogger("shoal.serve")

# After the engine dies, keep answering (503 on /health, 500 with the root cause on requests)
# this long before exiting, so probes and clients see why.
DEAD_LINGER_ENV = "SHOAL_DEAD_LINGER_S"
DEFAULT_DEAD_LINGER_S = 2.0

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.I)


def parse_bytes(text: str) -> int:
    """'1073741824', '512M', '2GiB', '1.5G' -> bytes (K/M/G/T are powers of 1024, like vLLM)."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2147483648, 512M, 2G)")
    value, unit = float(m.group(1)), m.group(2).lower()
    return int(value * 1024 ** " kmgt".index(unit or " "))


class _Parser(argparse.ArgumentParser):
    """argparse that also leaves the termination message: a bad flag is a config error the
    operator must see (and not restart), not an exit 2 with nothing said."""

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
    p.add_argument("model", help="local model directory (config.json, safetensors, tokenizer); "
                                 "`shoal make-model DIR` writes one")
    net = p.add_argument_group("HTTP")
    net.add_argument("--host", default="0.0.0.0", help="address to listen on")
    net.add_argument("--port", type=int, default=8000, help="port to listen on")
    net.add_argument("--served-model-name", nargs="+", default=None,
                     help="model name(s) clients send as `model`; the first is reported in "
                          "responses (default: the model path)")
    net.add_argument("--api-key", default=os.environ.get("SHOAL_API_KEY"),
                     help="require 'Authorization: Bearer KEY' on /v1/* (env SHOAL_API_KEY)")
    eng = p.add_argument_group("engine")
    eng.add_argument("--max-model-len", type=int, default=None,
                     help="context length (prompt + output); default: the model's own")
    eng.add_argument("--max-num-seqs", type=int, default=None,
                     help="most requests running in one batch (default, vLLM's: 128 per rank on "
                          "the CPU, 256 on a GPU)")
    eng.add_argument("--max-num-batched-tokens", type=int, default=None,
                     help="token budget of one engine step, long prompts are chunked (default, "
                          "vLLM's: 2048 per rank on the CPU, 2048 on a GPU)")
    eng.add_argument("--performance-mode", choices=PERFORMANCE_MODES, default="balanced",
                     help="throughput: twice the default seats and token budget, for "
                          "aggregate tokens/s over per-request latency (vLLM's flag)")
    eng.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    eng.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                     default=True, help="reuse KV blocks of shared prompt prefixes")
    eng.add_argument("--dtype", default="auto",
                     choices=["auto", "float32", "bfloat16", "float16"],
                     help="weight/activation/KV dtype; auto = the model's own, but float32 "
                          "checkpoints run in bfloat16 on CUDA and on CPUs with native bf16 "
                          "(as vLLM)")
    eng.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
    eng.add_argument("--seed", type=int, default=0,
                     help="seed of the engine's generator for unseeded sampled requests")
    eng.add_argument("--kv-cache-memory-bytes", type=parse_bytes, default=None,
                     help="KV-cache budget, e.g. 2G (default: $SHOAL_KV_CACHE_SPACE GiB, else 1 GiB)")
    eng.add_argument("--num-gpu-blocks-override", type=int, default=None,
                     help="use exactly this many KV blocks instead of sizing from the budget")
    eng.add_argument("--num-threads", type=int, default=None,
                     help="torch threads of each engine rank (default: the CPUs this process "
                          "may use (affinity, cgroup CPU limit) split over this node's ranks)")
    eng.add_argument("--max-logprobs", type=int, default=20,
                     help="most logprobs (alternatives per token) a request's logprobs, "
                          "top_logprobs or prompt_logprobs may ask for")
    eng.add_argument("--shutdown-timeout", type=float, default=0.0,
                     help="on SIGTERM: 0 = abort in-flight requests (they finish with reason "
                          "'abort'); N > 0 = drain: refuse new requests (503) and finish running "
                          "ones for up to N seconds, then abort the rest")
    par = p.add_argument_group("parallelism (docs/serving.md, \"More than one rank\")")
    par.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                     help="ranks per model replica; every layer is split over them")
    par.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                     help="pipeline stages (only 1 is implemented)")
    par.add_argument("--nnodes", type=int, default=1,
                     help="nodes the ranks are spread over (tensor-parallel-size / nnodes each)")
    par.add_argument("--node-rank", type=int, default=0,
                     help="this node's rank in the group; nodes other than 0 run --headless")
    par.add_argument("--master-addr", default="127.0.0.1",
                     help="node 0's address: torch.distributed, step broadcast, group link")
    par.add_argument("--master-port", type=int, default=29500,
                     help="node 0's torch.distributed port (multi-node; the group link uses "
                          "port + 1)")
    par.add_argument("--headless", action="store_true",
                     help="run this node's workers only (no API server, no scheduler); needs "
                          "--nnodes > 1 and --node-rank > 0")
    p.add_argument("--engine-host", default=None,
                   help="bind the engine sockets on tcp://HOST instead of ipc:// (remote engine)")
    tools = p.add_argument_group("tool calling (docs/serving.md, \"Structured output and tools\")")
    tools.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='allow tool_choice "auto" (the default with tools): the model calls '
                            "tools in its own words, read by --tool-call-parser")
    tools.add_argument("--tool-call-parser", choices=["hermes"], default=None,
                       help="how tool calls are found in free text under tool_choice \"auto\": "
                            "hermes = <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def _config_error(message: str, cause=None) -> int:
    from shoal.contract.termination import Cause, write_termination_message

    logger.error("configuration error: %s", message)
    print(f"shoal serve: error: {message}", file=sys.stderr)
    write_termination_message(cause or Cause.CONFIG_ERROR, message, exit_code=2)
    return 2


def _check_parallelism(args) -> str | None:
    """What EngineConfig cannot know: the pipeline flag and the node roles."""
    if args.pipeline_parallel_size != 1:
        return (f"--pipeline-parallel-size {args.pipeline_parallel_size} is not implemented; "
                "shoal splits a model over ranks with --tensor-parallel-size only")
    if args.headless and (args.nnodes < 2 or args.node_rank < 1):
        return (f"--headless runs the workers of a non-zero node of a multi-node group; got "
                f"--nnodes {args.nnodes} --node-rank {args.node_rank}")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        return "--enable-auto-tool-choice needs --tool-call-parser (hermes)"
    if args.node_rank > 0 and not args.headless:
        return (f"--node-rank {args.node_rank} runs no API server: add --headless (node 0 runs "
                "the server and the EngineCore)")
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    role = f"node {args.node_rank}" if args.headless else "frontend"
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s [{role}] %(message)s")
    started = time.monotonic()
    problem = _check_parallelism(args)
    if problem:
        return _config_error(problem)
    from shoal.engine.config import EngineConfig

    seats, tokens = serving_batch_defaults(args.device, args.tensor_parallel_size,
                                           args.performance_mode)
    try:
        config = EngineConfig(
            model=args.model, dtype=args.dtype, device=args.device,
            max_model_len=args.max_model_len,
            max_num_seqs=seats if args.max_num_seqs is None else args.max_num_seqs,
            max_num_batched_tokens=(tokens if args.max_num_batched_tokens is None
                                    else args.max_num_batched_tokens),
            block_size=args.block_size,
            enable_prefix_caching=args.enable_prefix_caching,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            num_kv_blocks=args.num_gpu_blocks_override, seed=args.seed,
            num_threads=args.num_threads, max_logprobs=args.max_logprobs,
            tensor_parallel_size=args.tensor_parallel_size,
            nnodes=args.nnodes, node_rank=args.node_rank, master_addr=args.master_addr,
            master_port=args.master_port)
    except ValueError as exc:  # errors.ConfigError: known at start-up, permanent
        from shoal.contract.termination import Cause
        from shoal.engine.errors import ModelNotFoundError

        return _config_error(str(exc), Cause.MODEL_NOT_FOUND
                             if isinstance(exc, ModelNotFoundError) else Cause.CONFIG_ERROR)
    if config.num_threads is None:
        import dataclasses

        from shoal.engine.worker.cpu.cpus import engine_threads

        config = dataclasses.replace(config,
                                     num_threads=engine_threads(len(config.local_ranks())))
    if args.headless:
        from shoal.engine.executor.headless import run_headless

        return run_headless(config)
    names = args.served_model_name or [args.model]

    # Until uvicorn installs its handlers: a signal during start-up stops start-up cleanly.
    def _startup_signal(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, _startup_signal)
    from shoal.engine.errors import EngineDeadError, EngineStartupError
    from shoal.engine.frontend.async_llm import AsyncLLM

    logger.info("starting engine for %s (loading tokenizer meanwhile)", args.model)
    # The HTTP stack imports while the engine loads its weights, not after.
    import threading

    threading.Thread(target=_import_http_stack, name="import-http", daemon=True).start()
    try:
        llm = AsyncLLM(config, served_model_name=names[0], shutdown_timeout=args.shutdown_timeout,
                       host=args.engine_host, log_level=args.log_level)
    except EngineDeadError as exc:
        logger.error("engine failed during start-up: %s", exc.dead.describe())
        _write_dead(exc)
        return 1
    except EngineStartupError as exc:
        from shoal.contract.termination import Cause, write_termination_message

        logger.error("engine start-up failed: %s", exc)
        write_termination_message(Cause.STARTUP_ERROR, str(exc), exit_code=1)
        return 1
    except KeyboardInterrupt as exc:  # a requested stop: not a failure
        logger.info("stopped during start-up (%s); the engine was stopped", exc or "SIGINT")
        return 0 if str(exc) == "SIGTERM" else 130
    r = llm.ready
    logger.info("engine ready: %d KV blocks x %d tokens, max_model_len %d, %d seats, %d tokens "
                "per step, engine start-up %.1f s", r.num_blocks, r.block_size, r.max_model_len,
                config.max_num_seqs, config.max_num_batched_tokens, r.startup_seconds)
    from shoal.engine.entrypoints import event_loop

    return event_loop.run(_serve(llm, args, names, started))


def _import_http_stack() -> None:
    import shoal.engine.entrypoints.api_server  # noqa: F401
    import uvicorn  # noqa: F401


def _write_dead(exc) -> None:
    from shoal.engine.core.engine_core_proc.death import write_dead_termination

    write_dead_termination(exc.dead)


async def _serve(llm, args, names: list[str], started: float) -> int:
    import uvicorn
    from shoal.engine.entrypoints.api_server import build_app
    from shoal.engine.entrypoints.tool_calls import ToolSettings

    app = build_app(llm, served_model_names=names, api_key=args.api_key,
                    tool_settings=ToolSettings(args.enable_auto_tool_choice, args.tool_call_parser))
    loop = asyncio.get_running_loop()
    state = {"rc": 0, "signalled": False}

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:
            if state["signalled"]:
                logger.warning("second %s: exiting now", signal.Signals(sig).name)
                self.force_exit = True
                self.should_exit = True
                llm.engine_core.engine.kill()
                return
            state["signalled"] = True
            mode = "abort" if args.shutdown_timeout <= 0 else f"drain {args.shutdown_timeout:g} s"
            logger.info("received %s: shutting down (%s); new requests get 503",
                        signal.Signals(sig).name, mode)
            llm.begin_shutdown()
            proc = llm.engine_core.engine.proc
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            else:
                self.should_exit = True

    server = Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                   access_log=False, timeout_graceful_shutdown=10,
                                   timeout_keep_alive=5))

    def on_dead(err) -> None:
        state["rc"] = 1
        logger.error("engine died: %s; exiting with code 1", err.dead.describe())
        _write_dead(err)
        linger = float(os.environ.get(DEAD_LINGER_ENV, DEFAULT_DEAD_LINGER_S))
        loop.call_later(linger, lambda: setattr(server, "should_exit", True))

    def on_stopped() -> None:
        if not state["signalled"]:
            state["rc"] = 1
            logger.error("the engine stopped although this server did not ask it to; exiting")
        server.should_exit = True

    llm.on_engine_dead.append(on_dead)
    llm.on_engine_stopped.append(on_stopped)
    llm.start()

    async def announce() -> None:
        while not server.started:
            await asyncio.sleep(0.05)
        host = "localhost" if args.host in ("0.0.0.0", "::", "") else args.host
        logger.info("ready: http://%s:%d/v1 serving %s (start-up %.1f s)", host, args.port,
                    ", ".join(names), time.monotonic() - started)

    announcer = loop.create_task(announce())
    try:
        await server.serve()
    except SystemExit as exc:  # uvicorn exits this way when it cannot bind
        state["rc"] = int(exc.code or 1)
    finally:
        announcer.cancel()
    if not server.started and state["rc"] == 0:
        state["rc"] = 1  # never served (bind failure)
    rc_engine = await asyncio.to_thread(llm.shutdown, args.shutdown_timeout + 15)
    logger.info("stopped (engine exit code %s); exit code %d", rc_engine, state["rc"])
    return state["rc"]
