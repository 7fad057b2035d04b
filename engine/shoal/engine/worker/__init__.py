"""The device side of the engine: Worker (device, memory) and ModelRunner (model, KV, sampling)."""
