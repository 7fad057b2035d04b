"""LoRA adapters made with the real `peft` on the project's own models, and their greedy
reference outputs through transformers + PEFT (PeftModel.from_pretrained): what the engine's
LoRA tests compare against."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

ALL_PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base_path: str, out: Path, seed: int, *, r: int = 8, alpha: float = 16,
                 targets: list[str] | None = None, b_std: float = 0.05, **extra) -> str:
    """A PEFT LoRA adapter of the base model with random non-zero A and B (a fresh adapter's B
    is zero, which would change nothing), saved with save_pretrained."""
    return make_adapters(base_path, [(out, seed)], r=r, alpha=alpha, targets=targets,
                         b_std=b_std, **extra)[0]


def make_adapters(base_path: str, outs: list[tuple[Path, int]], *, r: int = 8,
                  alpha: float = 16, targets: list[str] | None = None, b_std: float = 0.05,
                  **extra) -> list[str]:
    """make_adapter for each (out, seed), reading the base model once (a large model takes
    seconds to read): the same peft model refilled from each seed's generator, so each adapter
    is the one make_adapter writes for that seed."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets or ALL_PROJ,
                     lora_dropout=0.0, task_type="CAUSAL_LM", **extra)
    model = get_peft_model(base, cfg)
    paths = []
    for out, seed in outs:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_A" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
                elif "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * b_std)
        model.save_pretrained(str(out))
        paths.append(str(out))
    return paths


def greedy_config(model, max_new: int):
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id, config.do_sample, config.max_new_tokens = None, False, max_new
    return config


def reference(base_path: str, adapter: str | None, prompts: list[list[int]],
              max_new: int) -> list[list[int]]:
    """transformers' greedy generate, each prompt alone, with the adapter through PEFT (None:
    the base model)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            gen = model.generate(torch.tensor([p]), generation_config=greedy_config(model,
                                                                                    max_new))
            out.append(gen[0, len(p):].tolist())
    return out
