"""LoRA adapters between the operator, the routers and an engine (Shoal's or a stock vLLM):
vLLM's own HTTP surface, so both runtimes answer the same. Append-only.

- An engine loads and unloads adapters at runtime only when RUNTIME_UPDATES_ENV is true (vLLM
  reads "1" or "true"); the operator sets it on the engine of an InferenceEngine with spec.lora.
- LOAD_PATH takes {"lora_name", "lora_path"}, UNLOAD_PATH {"lora_name"}: 200 with a text, or an
  OpenAI error body; a 400 is the adapter's own fault (rank, modules, base model: the same on
  every group), a 404 a path that is not there (yet).
- `/v1/models` lists an adapter as a card whose `parent` is set (vLLM's ModelCard); `listed`
  reads them, for the routers (where to send a request) and the operator (what a group has).
"""

from __future__ import annotations

import json

RUNTIME_UPDATES_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
MODELS_PATH = "/v1/models"


def runtime_updates_allowed(environ) -> bool:
    return environ.get(RUNTIME_UPDATES_ENV, "0").strip().lower() in ("1", "true")


def listed(models_body: bytes | str) -> dict[str, str] | None:
    """adapter name -> its parent, from an engine's /v1/models body; None if it is not one."""
    try:
        data = json.loads(models_body)
        cards = data["data"]
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(cards, list):
        return None
    return {c["id"]: c["parent"] for c in cards
            if isinstance(c, dict) and isinstance(c.get("id"), str) and c.get("parent")}
