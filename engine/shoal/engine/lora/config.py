"""LoRAConfig (vLLM's --max-loras, --max-lora-rank, --max-cpu-loras) and --lora-modules.

Imports neither torch nor transformers: the frontend and EngineConfig use it.
"""

from __future__ import annotations

import dataclasses
import json

from shoal.engine.errors import ConfigError
from shoal.engine.wire import LoRARequest


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """max_loras: adapters on the device at once (one step runs at most this many distinct
    adapters); max_lora_rank: the largest rank an adapter may have; max_cpu_loras: adapters kept
    in host memory (None = max_loras, as vLLM)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ConfigError(f"--max-loras must be at least 1, got {self.max_loras}.")
        if self.max_lora_rank < 1:
            raise ConfigError(f"--max-lora-rank must be at least 1, got {self.max_lora_rank}.")
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        elif self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"--max-cpu-loras ({self.max_cpu_loras}) must be >= --max-loras "
                              f"({self.max_loras}), as vLLM requires.")


def parse_lora_module(text: str) -> tuple[str, str, str | None]:
    """One --lora-modules value, vLLM's two forms: `name=path`, or JSON
    `{"name": ..., "path": ..., "base_model_name": ...}` -> (name, path, base_model_name)."""
    text = text.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--lora-modules {text!r}: invalid JSON: {exc}") from None
        unknown = sorted(set(obj) - {"name", "path", "base_model_name"})
        if unknown or not isinstance(obj.get("name"), str) or not isinstance(obj.get("path"), str):
            raise ConfigError(f"--lora-modules {text!r}: the JSON form takes \"name\" and "
                              f"\"path\" (strings) and an optional \"base_model_name\""
                              + (f"; unknown keys {unknown}" if unknown else ""))
        return obj["name"], obj["path"], obj.get("base_model_name")
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ConfigError(f"--lora-modules {text!r}: expected name=path or JSON "
                          "{\"name\": ..., \"path\": ..., \"base_model_name\": ...}")
    return name, path, None


class AdapterNotFound(Exception):
    """An adapter's path is neither a directory nor a hub id the hub gives (the endpoint's 404,
    as vLLM's NotFoundError)."""


class LoRARegistry:
    """The frontend's adapters by name (static --lora-modules, runtime loads), each with the
    integer id the engine keys it by; ids are never reused, so a reloaded adapter is new to
    the prefix cache. `download_dir` and `token` are serve's --download-dir and --hf-token:
    where an adapter given as a hub id is downloaded (`local_path`)."""

    def __init__(self, download_dir: str | None = None, token: str | None = None) -> None:
        self.adapters: dict[str, LoRARequest] = {}
        self._next_id = 1
        self.download_dir, self.token = download_dir, token

    def local_path(self, path: str) -> str:
        """The directory to read an adapter from: `path` when it is a directory (or not a hub
        id: the engine then says it does not exist); a hub id ORG/NAME, as vLLM's
        get_adapter_absolute_path does, downloaded with huggingface_hub (at main, only the
        files an engine reads) and its snapshot directory. Blocking: call it off the loop.
        Raises AdapterNotFound naming the id, the cache and why (offline, no such repo, no
        access, hub unreachable)."""
        import os

        from shoal.engine import model_files

        if os.path.isdir(path) or not model_files.is_hub_id(path):
            return path
        try:
            return model_files.resolve(path, download_dir=self.download_dir, token=self.token,
                                       ignore_patterns=(), what="LoRA adapter").path
        except model_files.ResolveError as exc:
            raise AdapterNotFound(str(exc)) from None

    def new(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        req = LoRARequest(name, self._next_id, path, base_model_name)
        self._next_id += 1
        return req

    def add(self, req: LoRARequest) -> None:
        self.adapters[req.lora_name] = req

    def remove(self, name: str) -> LoRARequest | None:
        return self.adapters.pop(name, None)

    def get(self, name: str) -> LoRARequest | None:
        return self.adapters.get(name)
