"""vLLM's `LoRARequest(lora_name, lora_int_id, lora_path)` for the offline API
(`from shoal.engine.lora.request import LoRARequest`): the wire struct itself."""

from shoal.engine.wire import LoRARequest

__all__ = ["LoRARequest"]
