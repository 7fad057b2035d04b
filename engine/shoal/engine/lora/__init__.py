"""LoRA adapters (vLLM's --enable-lora): PEFT adapters on the attention and MLP projections,
many adapters and the base model in one batch. docs/engine.md, "LoRA adapters"."""
