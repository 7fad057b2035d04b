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

import asyncio
import logging
import os
import signal
import sys
import time

from shoal.engine.config import serving_batch_defaults
from shoal.engine.entrypoints.serve_flags import build_parser, parse_bytes  # noqa: F401

logger = logging.getLogger("shoal.serve")

# After the engine dies, keep answering (503 on /health, 500 with the root cause on requests)
# this long before exiting, so probes and clients see why.
DEAD_LINGER_ENV = "SHOAL_DEAD_LINGER_S"
DEFAULT_DEAD_LINGER_S = 2.0


def _config_error(message: str, cause=None) -> int:
    from shoal.contract.termination import Cause, write_termination_message

    logger.error("configuration error: %s", message)
    print(f"shoal serve: error: {message}", file=sys.stderr)
    write_termination_message(cause or Cause.CONFIG_ERROR, message, exit_code=2)
    return 2


def _check_vllm_flags(args) -> str | None:
    """vLLM's spellings resolved (--model, --dtype half), the flags of vllm_flags.py's table
    this server has no use for logged once, and the first refused one."""
    from shoal.engine.entrypoints import vllm_flags

    args.model = args.model or args.model_flag
    if not args.model:
        return "no model: pass the model directory (shoal serve DIR, or --model DIR)"
    args.dtype = _DTYPE_ALIASES.get(args.dtype, args.dtype)
    args.max_model_len = None if args.max_model_len == -1 else args.max_model_len
    notes, refused = vllm_flags.check(args)
    for note in notes:
        logger.info("%s", note)
    return refused


def _check_model_flags(args) -> str | None:
    """What needs the model's config.json (--trust-remote-code) and the chat template."""
    from shoal.engine.config import read_model_config
    from shoal.engine.entrypoints import vllm_flags

    problem = vllm_flags.startup_problem(args, read_model_config(args.model))
    if problem or args.chat_template is None:
        return problem
    try:
        args.chat_template = load_chat_template(args.chat_template)
    except OSError as exc:
        return f"--chat-template {args.chat_template!r} looks like a file path but: {exc}"
    return None


def load_chat_template(value: str) -> str:
    """--chat-template as vLLM 0.32 reads it (renderers/chat_utils.py): a file's text, else the
    value itself when it looks like a template ({, } or a newline), else OSError."""
    try:
        with open(value) as f:
            return f.read()
    except OSError:
        if not any(c in value for c in "{}\n"):
            raise
        return value


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


_DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's --dtype names


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    role = f"node {args.node_rank}" if args.headless else "frontend"
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s [{role}] %(message)s")
    started = time.monotonic()
    problem = _check_vllm_flags(args) or _check_parallelism(args)
    if problem:
        return _config_error(problem)
    rc = _resolve_model(args)
    if rc:
        return rc
    _choose_device(args)
    config = _engine_config(args)
    if isinstance(config, int):
        return config
    problem = _check_model_flags(args)
    if problem:
        return _config_error(problem)
    if args.headless:
        from shoal.engine.executor.headless import run_headless

        return run_headless(config)
    defaults = _sampling_defaults(args)
    if isinstance(defaults, int):
        return defaults
    names = args.served_model_name or [args.model]
    llm = _start_engine(config, args, names)
    if isinstance(llm, int):
        return llm
    if args.chat_template is not None:
        llm.tokenizer.chat_template = args.chat_template
        if hasattr(llm.tokenizer, "_template"):
            llm.tokenizer._template = None  # FastTokenizer compiles it on first use
        logger.info("chat template: --chat-template (%d characters)", len(args.chat_template))
    from shoal.engine.entrypoints import event_loop

    return event_loop.run(_serve(llm, args, names, started, defaults))


def _sampling_defaults(args):
    """The model's generation_config sampling values (logged once), or exit code 2."""
    from shoal.engine import generation_config

    try:
        defaults = generation_config.sampling_defaults(args.model, args.generation_config)
    except ValueError as exc:
        return _config_error(str(exc))
    if defaults:
        logger.info("%s", generation_config.describe(defaults, args.generation_config))
    return defaults


def _resolve_model(args) -> int:
    """The model (and --tokenizer) as local directories: a hub id resolved from the Hugging
    Face cache or the hub (model_files.py), each in one line; served as the id given. 0, or the
    exit code of a model that is not there (termination message naming id, revision, cache)."""
    from shoal.contract.termination import write_termination_message
    from shoal.engine.model_files import DEFAULT_IGNORE, ResolveError, resolve

    hub = dict(download_dir=args.download_dir, token=args.hf_token,
               ignore_patterns=tuple(args.ignore_patterns or DEFAULT_IGNORE))
    try:
        model = resolve(args.model, revision=args.revision, **hub)
        tokenizer = None if args.tokenizer is None else resolve(
            args.tokenizer, revision=args.tokenizer_revision or args.revision, what="tokenizer",
            **hub)
    except ResolveError as exc:
        logger.error("%s", exc)
        print(f"shoal serve: error: {exc}", file=sys.stderr)
        write_termination_message(exc.cause, str(exc), exit_code=exc.exit_code)
        return exc.exit_code
    for found in (model, tokenizer):
        if found is not None:
            logger.info("%s", found.how)
    args.served_model_name = args.served_model_name or [args.model]
    args.model = model.path
    args.tokenizer = None if tokenizer is None else tokenizer.path
    return 0


def _choose_device(args) -> None:
    """--device auto made concrete before the batch defaults, which depend on it (one line)."""
    from shoal.engine.device import choose_device, probe_cuda

    choice = choose_device(args.device, probe_cuda() if args.device == "auto" else None)
    logger.info("%s", choice.log_line)
    args.device = choice.device


def _gpu_memory_utilization(args) -> float:
    """vLLM's 0.9 unless given; given on the CPU, accepted with no effect, said once."""
    if args.gpu_memory_utilization is None:
        return 0.9
    if not args.device.startswith("cuda"):
        logger.info("--gpu-memory-utilization %s: accepted, no effect: on the CPU the KV "
                    "budget is --kv-cache-memory-bytes, else VLLM_CPU_KVCACHE_SPACE / "
                    "SHOAL_KV_CACHE_SPACE GiB, else 1 GiB", args.gpu_memory_utilization)
    return args.gpu_memory_utilization


def _engine_config(args):
    """The EngineConfig the flags ask for (vLLM's batch defaults where unset), or exit code 2
    with the termination message written."""
    from shoal.engine.config import EngineConfig

    seats, tokens = serving_batch_defaults(args.device, args.tensor_parallel_size,
                                           args.performance_mode)
    try:
        lora_config = _lora_config(args)
        config = EngineConfig(
            model=args.model, tokenizer=args.tokenizer, dtype=args.dtype, device=args.device,
            max_model_len=args.max_model_len,
            max_num_seqs=seats if args.max_num_seqs is None else args.max_num_seqs,
            max_num_batched_tokens=(tokens if args.max_num_batched_tokens is None
                                    else args.max_num_batched_tokens),
            block_size=args.block_size,
            enable_prefix_caching=args.enable_prefix_caching,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            gpu_memory_utilization=_gpu_memory_utilization(args),
            num_kv_blocks=args.num_gpu_blocks_override, seed=args.seed,
            num_threads=args.num_threads, max_logprobs=args.max_logprobs,
            tensor_parallel_size=args.tensor_parallel_size,
            nnodes=args.nnodes, node_rank=args.node_rank, master_addr=args.master_addr,
            master_port=args.master_port, kv_events_config=args.kv_events_config,
            lora_config=lora_config)
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
    return config


def _lora_config(args):
    """--enable-lora's LoRAConfig (None without it) and --lora-modules parsed into
    args.lora_module_list; ConfigError naming the flag."""
    from shoal.engine.errors import ConfigError
    from shoal.engine.lora.config import LoRAConfig, parse_lora_module

    args.lora_module_list = [parse_lora_module(m) for m in args.lora_modules or ()]
    if not args.enable_lora:
        if args.lora_module_list:
            raise ConfigError("--lora-modules needs --enable-lora")
        return None
    return LoRAConfig(args.max_loras, args.max_lora_rank, args.max_cpu_loras)


def _startup_signal(signum, frame):
    """Until uvicorn installs its handlers: a signal during start-up stops start-up cleanly."""
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _start_engine(config, args, names: list[str]):
    """AsyncLLM with its engine process ready, or the exit code of a failed start-up."""
    signal.signal(signal.SIGTERM, _startup_signal)
    from shoal.engine.errors import EngineDeadError, EngineStartupError
    from shoal.engine.frontend.async_llm import AsyncLLM

    logger.info("starting engine for %s (loading tokenizer meanwhile)", args.model)
    # The HTTP stack imports while the engine loads its weights, not after.
    import threading

    threading.Thread(target=_import_http_stack, name="import-http", daemon=True).start()
    try:
        llm = AsyncLLM(config, served_model_name=names[0], shutdown_timeout=args.shutdown_timeout,
                       host=args.engine_host, log_level=args.log_level,
                       scheduling_policy=args.scheduling_policy)
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
    return llm


def _import_http_stack() -> None:
    import shoal.engine.entrypoints.api_server  # noqa: F401
    import uvicorn  # noqa: F401


def _write_dead(exc) -> None:
    from shoal.engine.core.engine_core_proc.death import write_dead_termination

    write_dead_termination(exc.dead)


def _http_server(app, llm, args, state: dict):
    """uvicorn's Server whose first signal shuts the engine down (drain or abort by
    --shutdown-timeout) and whose second one kills it."""
    import uvicorn

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

    return Server(uvicorn.Config(app, host=args.host, port=args.port, **_uvicorn_settings(args),
                                 timeout_graceful_shutdown=10, timeout_keep_alive=5))


def _uvicorn_settings(args) -> dict:
    """vLLM's uvicorn flags: log level, access log, root path, TLS, h11 limit."""
    chatty = args.uvicorn_log_level in ("info", "debug", "trace")
    return dict(log_level=args.uvicorn_log_level,
                access_log=chatty and not args.disable_uvicorn_access_log,
                root_path=args.root_path or "", ssl_keyfile=args.ssl_keyfile,
                ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs,
                ssl_cert_reqs=args.ssl_cert_reqs,
                h11_max_incomplete_event_size=args.h11_max_incomplete_event_size)


def _watch_engine(llm, server, state: dict) -> None:
    """Stop serving when the engine dies (after the linger, exit 1) or stops unasked."""
    loop = asyncio.get_running_loop()

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


async def _announce(server, args, names: list[str], started: float) -> None:
    while not server.started:
        await asyncio.sleep(0.05)
    host = "localhost" if args.host in ("0.0.0.0", "::", "") else args.host
    scheme = "https" if args.ssl_certfile else "http"
    logger.info("ready: %s://%s:%d/v1 serving %s (start-up %.1f s)", scheme, host, args.port,
                ", ".join(names), time.monotonic() - started)


async def _serve(llm, args, names: list[str], started: float, defaults: dict) -> int:
    from shoal.contract.auth import api_keys
    from shoal.engine.entrypoints.api_server import HttpSettings, build_app
    from shoal.engine.entrypoints.serving import OutputSettings
    from shoal.engine.entrypoints.serving_lora import load_static_adapters
    from shoal.engine.entrypoints.tool_calls import ToolSettings
    from shoal.engine.errors import ConfigError
    from shoal.engine.lora.config import LoRARegistry

    keys = api_keys(args.api_key, os.environ)
    logger.info("API key: %s", f"{len(keys)} accepted on /v1" if keys else "none (open)")
    tools = ToolSettings(args.enable_auto_tool_choice, args.tool_call_parser,
                         args.reasoning_parser)
    loras = (LoRARegistry(download_dir=args.download_dir, token=args.hf_token)
             if args.enable_lora else None)
    try:
        app = build_app(llm, served_model_names=names, api_keys=keys, sampling_defaults=defaults,
                        tool_settings=tools, http=HttpSettings.from_args(args),
                        output=OutputSettings.from_args(args), loras=loras)
    except ConfigError as exc:  # a flag the model cannot take (e.g. a reasoning parser's tags)
        llm.shutdown()
        return _config_error(str(exc))
    state = {"rc": 0, "signalled": False}
    server = _http_server(app, llm, args, state)
    _watch_engine(llm, server, state)
    llm.start()
    if args.lora_module_list:  # each read and checked in the engine before the server answers
        try:
            await load_static_adapters(llm, loras, args.lora_module_list)
        except ValueError as exc:
            await asyncio.to_thread(llm.shutdown)
            return _config_error(str(exc))
    announcer = asyncio.get_running_loop().create_task(_announce(server, args, names, started))
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
