"""The model's generation_config.json sampling defaults, as vLLM applies them.

vLLM (`--generation-config auto`, its default) reads the model's generation_config.json and
uses its sampling values as the server's defaults: a request's own value wins, a value it does
not send comes from the model, and only then from vLLM's neutral defaults
(ModelConfig.get_diff_sampling_param; the offline LLM's get_default_sampling_params). The same
model therefore samples the same way under both servers. `--generation-config vllm` ignores
the file; `--generation-config DIR` reads DIR/generation_config.json instead.

Pure and torch-free: the frontend process reads it with the standard library.
"""

from __future__ import annotations

import json
from pathlib import Path

# vLLM's list (get_diff_sampling_param's available_params); max_new_tokens is the default
# max_tokens.
SAMPLING_KEYS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature",
                 "top_k", "top_p", "min_p", "max_new_tokens")
SOURCES_HELP = "auto (the model's generation_config.json), vllm (ignore it) or a directory"


def diff_sampling_params(generation_config: dict) -> dict:
    """The sampling values a generation config sets (null ones are unset), vLLM's names."""
    found = {k: generation_config[k] for k in SAMPLING_KEYS
             if generation_config.get(k) is not None}
    if "max_new_tokens" in found:
        found["max_tokens"] = found.pop("max_new_tokens")
    return found


def sampling_defaults(model: str, source: str = "auto") -> dict:
    """The default sampling values for `model` under `--generation-config source`; {} when
    there is no file (or `vllm`). A file that is not JSON is a ValueError naming it."""
    if source == "vllm":
        return {}
    path = Path(model if source == "auto" else source).expanduser() / "generation_config.json"
    if not path.is_file():
        if source != "auto":
            raise ValueError(f"--generation-config {source}: no generation_config.json there "
                             f"(use {SOURCES_HELP}).")
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is not readable JSON: {exc}") from None
    return diff_sampling_params(config if isinstance(config, dict) else {})


def describe(defaults: dict, source: str = "auto") -> str:
    """The start-up line naming what was applied (vLLM logs the same once)."""
    where = "the model's generation_config.json" if source == "auto" else source
    values = ", ".join(f"{k}={v}" for k, v in defaults.items())
    return (f"default sampling parameters from {where}: {values} (a request's own values win; "
            "--generation-config vllm ignores them)")
