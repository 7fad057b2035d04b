"""Reading a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) and refusing,
by name, everything in it that the engine does not apply exactly.

What is applied: plain LoRA, `y = base(x) + (x @ A.T) @ B.T * scaling` on linear projections
the model has (q/k/v/o and gate/up/down as the model names them), scaling = lora_alpha / r
(lora_alpha / sqrt(r) with use_rslora), a per-module rank from rank_pattern included (read from
the tensors). Refused with LoRALoadError (a ValueError; a 400 at the API), naming the field,
module or numbers: another peft_type, DoRA, a bias, modules_to_save, alpha_pattern, and the
other options that change the computation; a module the engine cannot wrap (embeddings, the
LM head, a fused or Conv1D projection); a rank above --max-lora-rank; shapes that do not fit the
base model (an adapter for another model); a missing or unreadable path.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

import torch
from shoal.engine.wire import LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# Options that change what the adapter computes, refused when set (truthy): the engine applies
# plain LoRA only.
_REFUSED_OPTIONS = {
    "use_dora": "DoRA (weight-decomposed LoRA) is not implemented",
    "modules_to_save": "modules_to_save (fully trained copies of modules) are not applied",
    "alpha_pattern": "a per-module lora_alpha (alpha_pattern) is not implemented",
    "lora_bias": "a LoRA bias (lora_bias) is not implemented",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D-style weights) is not implemented",
    "use_qalora": "QA-LoRA is not implemented",
    "layer_replication": "layer_replication is not implemented",
    "target_parameters": "LoRA on parameters (target_parameters) is not implemented",
    "trainable_token_indices": "trainable token embeddings are not implemented",
    "alora_invocation_tokens": "activated LoRA (aLoRA) is not implemented",
    "arrow_config": "Arrow routing is not implemented",
}
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


class LoRALoadError(ValueError):
    """The adapter cannot be applied (the message says what); a 400 at the API."""


@dataclass
class ModuleLoRA:
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass
class LoRAWeights:
    request: LoRARequest
    modules: dict[str, ModuleLoRA] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return max((m.rank for m in self.modules.values()), default=0)


def _unreadable(file: Path, name: str) -> None:
    """A file this process may not read is named with its mode and owner (safetensors reports
    it as "No such file or directory"). The message says "not readable": the endpoint answers
    it as a path that is not there (404, retried by the operator), since fixing the file's mode
    is enough."""
    if os.access(file, os.R_OK):
        return
    st = file.stat()
    raise LoRALoadError(f"LoRA adapter {name!r}: {str(file)!r} is not readable by this process "
                        f"(uid {os.getuid()}; the file's mode {stat.filemode(st.st_mode)}, "
                        f"owner uid {st.st_uid})")


def _config(path: Path, name: str) -> dict:
    if not path.is_dir():
        raise LoRALoadError(f"LoRA adapter {name!r}: the path {str(path)!r} does not exist or is "
                            "not a directory")
    cfg_file = path / CONFIG_FILE
    if not cfg_file.is_file():
        raise LoRALoadError(f"LoRA adapter {name!r}: {str(path)!r} has no {CONFIG_FILE} (a PEFT "
                            "adapter directory, as save_pretrained writes it)")
    _unreadable(cfg_file, name)
    try:
        return json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise LoRALoadError(f"LoRA adapter {name!r}: cannot read {cfg_file}: {exc}") from None


def check_config(cfg: dict, name: str, max_rank: int) -> None:
    """Refuse, naming it, any option the engine does not apply exactly."""
    kind = cfg.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise LoRALoadError(f"LoRA adapter {name!r}: peft_type {kind!r} is not supported "
                            "(LORA only)")
    bias = cfg.get("bias", "none")
    if bias not in (None, "none"):
        raise LoRALoadError(f"LoRA adapter {name!r}: bias={bias!r} is not supported (trained "
                            "biases are not applied; 'none' only)")
    for option, why in _REFUSED_OPTIONS.items():
        if cfg.get(option):
            raise LoRALoadError(f"LoRA adapter {name!r}: {option}={cfg[option]!r}: {why}")
    rank = int(cfg.get("r", 0) or 0)
    pattern = cfg.get("rank_pattern") or {}
    top = max([rank, *(int(v) for v in pattern.values())])
    if top > max_rank:
        raise LoRALoadError(f"LoRA adapter {name!r}: rank {top} is greater than --max-lora-rank "
                            f"{max_rank}")


def read_adapter(request: LoRARequest, targets: dict[str, tuple[int, int]], max_rank: int,
                 num_layers_hint: str = "") -> LoRAWeights:
    """The adapter's A/B per module (float32, on the host), checked against `targets`: the
    model's wrappable modules, name -> (in_features, out_features)."""
    from safetensors.torch import load_file

    name, path = request.lora_name, Path(request.lora_path)
    cfg = _config(path, name)
    check_config(cfg, name, max_rank)
    weights_file = path / WEIGHTS_FILE
    if not weights_file.is_file():
        have = sorted(p.name for p in path.iterdir())
        raise LoRALoadError(f"LoRA adapter {name!r}: {str(path)!r} has no {WEIGHTS_FILE} "
                            f"(files: {have}); only safetensors weights are read")
    _unreadable(weights_file, name)
    try:
        tensors = load_file(str(weights_file))
    except Exception as exc:  # noqa: BLE001 - safetensors' errors have no common base
        raise LoRALoadError(f"LoRA adapter {name!r}: cannot read {weights_file}: {exc}") from None
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise LoRALoadError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA A/B weight "
                                "of a linear layer; it cannot be applied")
        module = m.group("module")
        if module not in targets:
            short = module.rsplit(".", 1)[-1]
            raise LoRALoadError(
                f"LoRA adapter {name!r}: module {module!r} cannot be applied: the engine applies "
                f"LoRA to the linear projections {sorted({t.rsplit('.', 1)[-1] for t in targets})}"
                f" of this model, and {short!r} is not one of them{num_layers_hint}")
        parts.setdefault(module, {})[m.group("ab")] = t
    alpha = float(cfg.get("lora_alpha", 8))
    rslora = bool(cfg.get("use_rslora", False))
    out = LoRAWeights(request)
    for module, ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise LoRALoadError(f"LoRA adapter {name!r}: module {module!r} has lora_"
                                f"{''.join(sorted(ab))} but not both A and B")
        a, b = ab["A"], ab["B"]
        n_in, n_out = targets[module]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != n_in or b.shape != (n_out, r):
            raise LoRALoadError(
                f"LoRA adapter {name!r}: module {module!r} has lora_A {tuple(a.shape)} and "
                f"lora_B {tuple(b.shape)}, but the base model's layer is {n_in} -> {n_out} "
                f"(expected ({r}, {n_in}) and ({n_out}, {r})): an adapter for another base model")
        if r > max_rank:
            raise LoRALoadError(f"LoRA adapter {name!r}: module {module!r} has rank {r}, greater "
                                f"than --max-lora-rank {max_rank}")
        scaling = alpha / math.sqrt(r) if rslora else alpha / r
        out.modules[module] = ModuleLoRA(a.float().contiguous(), b.float().contiguous(), scaling)
    if not out.modules:
        raise LoRALoadError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    return out
