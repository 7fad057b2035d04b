"""vLLM's runtime LoRA endpoints, POST /v1/load_lora_adapter and /v1/unload_lora_adapter:
served only when VLLM_ALLOW_RUNTIME_LORA_UPDATING is true ("1" or "true", as vLLM reads it);
otherwise the paths are not there (404), as in vLLM. Answers and error texts are vLLM's
(vllm/entrypoints/openai/serving_models.py): 200 "Success: LoRA adapter 'NAME' added
successfully."; 400 InvalidUserInput for a missing field or a name already loaded; 400
BadRequestError naming what the engine could not apply (lora/adapter.py), 404 NotFoundError
when the adapter's path is not there or a file is not readable (a fix outside the adapter);
unloading an unknown name is 404 NotFoundError.
Also `load_static_adapters`, --lora-modules at start-up (any failure stops the server)."""

from __future__ import annotations

import asyncio
import logging
import os

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel
from shoal.contract import lora as lora_contract
from shoal.engine.entrypoints.http_errors import error_response
from shoal.engine.entrypoints.serving import Serving
from shoal.engine.lora.config import AdapterNotFound, LoRARegistry
from shoal.engine.wire import LoRARequest

RUNTIME_UPDATES_ENV = lora_contract.RUNTIME_UPDATES_ENV

logger = logging.getLogger("shoal.engine.api")
_UTILITY_PREFIX = "engine utility call failed: "


def runtime_updates_allowed(environ=os.environ) -> bool:
    return lora_contract.runtime_updates_allowed(environ)


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str = ""
    lora_int_id: int | None = None


def _reason(exc: Exception) -> str:
    """The engine's own message: a utility failure comes back as 'engine utility call failed:
    LoRALoadError: ...'."""
    text = str(exc).removeprefix(_UTILITY_PREFIX)
    for kind in ("LoRALoadError: ", "ValueError: "):
        text = text.removeprefix(kind)
    return text


async def add_adapter(llm, registry: LoRARegistry, name: str, path: str,
                      base_model_name: str | None = None) -> LoRARequest:
    """Read and check the adapter in the engine, then serve it under `name` (raises the
    engine's error). A hub id is downloaded first (LoRARegistry.local_path): its snapshot
    directory is what the engine reads and /v1/models lists as the adapter's root."""
    local = await asyncio.to_thread(registry.local_path, path)
    req = registry.new(name, local, base_model_name)
    await llm.call_utility("add_lora", [req.lora_name, req.lora_int_id, req.lora_path,
                                        req.base_model_name])
    registry.add(req)
    logger.info("Loaded new LoRA adapter: name '%s', path '%s'", name, path)
    return req


async def load_static_adapters(llm, registry: LoRARegistry,
                               modules: list[tuple[str, str, str | None]]) -> None:
    """--lora-modules, each read and checked in the engine before the server answers; the
    first failure raises ValueError naming the adapter (the caller exits 2)."""
    for name, path, base in modules:
        try:
            await add_adapter(llm, registry, name, path, base)
        except Exception as exc:  # noqa: BLE001 - the engine's reason, re-raised with the flag
            raise ValueError(f"--lora-modules {name}={path}: {_reason(exc)}") from None


def lora_router(s: Serving) -> APIRouter:
    router = APIRouter()
    logger.warning("%s is set: runtime LoRA adapter loading (/v1/load_lora_adapter, "
                   "/v1/unload_lora_adapter) is enabled", RUNTIME_UPDATES_ENV)

    @router.post(lora_contract.LOAD_PATH)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        if s.loras is None:
            return error_response(400, "LoRA is not enabled: start the server with "
                                  "--enable-lora.", "BadRequestError")
        if not body.lora_name or not body.lora_path:
            return error_response(400, "Both 'lora_name' and 'lora_path' must be provided.",
                                  "InvalidUserInput")
        if body.load_inplace:
            return error_response(400, "load_inplace is not supported: unload the adapter and "
                                  "load it again.", "InvalidUserInput")
        if s.loras.get(body.lora_name) is not None or body.lora_name in s.served_model_names:
            return error_response(400, f"The lora adapter '{body.lora_name}' has already been "
                                  "loaded.", "InvalidUserInput")
        try:
            await add_adapter(s.llm, s.loras, body.lora_name, body.lora_path)
        except AdapterNotFound as exc:
            return error_response(404, str(exc), "NotFoundError")
        except Exception as exc:  # noqa: BLE001 - the engine's reason is the answer
            reason = _reason(exc)
            if "does not exist" in reason or "is not readable" in reason:
                return error_response(404, reason, "NotFoundError")
            return error_response(400, reason, "BadRequestError")
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added "
                                 "successfully.")

    @router.post(lora_contract.UNLOAD_PATH)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        if not body.lora_name and not body.lora_int_id:
            return error_response(400, "either 'lora_name' and 'lora_int_id' needs to be "
                                  "provided.", "InvalidUserInput")
        req = s.loras.get(body.lora_name) if s.loras is not None else None
        if req is None:
            return error_response(404, f"The lora adapter '{body.lora_name}' cannot be found.",
                                  "NotFoundError")
        s.loras.remove(body.lora_name)
        await s.llm.call_utility("remove_lora", req.lora_int_id)
        logger.info("Removed LoRA adapter: name '%s'", body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed "
                                 "successfully.")

    return router
