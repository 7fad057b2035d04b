"""LoRAManager: one rank's adapters: host copies (LRU, up to --max-cpu-loras) and device slots
(LRU over adapters idle this step, --max-loras), and the per-step LoRABatch.

The scheduler never runs more than max_loras distinct adapters in one step, so every adapter of
a step gets a slot: one already there stays, else a free slot or the least recently used slot
that no row of this step needs. An adapter evicted from the host is read again from its path
(the request carries it) when a request needs it.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

import torch
from shoal.engine.lora.adapter import LoRAWeights, read_adapter
from shoal.engine.lora.config import LoRAConfig
from shoal.engine.lora.layers import LoRABatch, LoRALinear, dense_parts
from shoal.engine.wire import LoRARequest
from torch import nn

log = logging.getLogger(__name__)

# The projections LoRA is applied to, as transformers' models name them.
TARGET_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def wrap_model(model: nn.Module, slots: int, max_rank: int, device) -> dict[str, LoRALinear]:
    """Wrap every projection named in TARGET_NAMES that is a linear layer (nn.Linear, or the
    CPU backend's packed one) in place; name -> wrapper, names as the model's own."""
    wrapped = {}
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if child_name not in TARGET_NAMES or not hasattr(child, "in_features"):
                continue
            layer = LoRALinear(child, slots, max_rank, device, scope=parent_name)
            setattr(parent, child_name, layer)
            wrapped[f"{parent_name}.{child_name}" if parent_name else child_name] = layer
    return wrapped


class LoRAManager:
    def __init__(self, model: nn.Module, config: LoRAConfig, device) -> None:
        self.config = config
        self.device = device
        self.layers = wrap_model(model, config.max_loras, config.max_lora_rank, device)
        self.targets = {n: (m.in_features, m.out_features) for n, m in self.layers.items()}
        self.host: OrderedDict[int, LoRAWeights] = OrderedDict()  # LRU: oldest first
        self.slots: list[int | None] = [None] * config.max_loras  # adapter id per slot
        self._slot_used = [0] * config.max_loras  # step number of the slot's last use
        self._step = 0
        self.load_seconds: dict[int, float] = {}  # the last read of each adapter, for the log
        log.info("LoRA: %d projections wrapped, %d device slots, rank <= %d, %d host copies",
                 len(self.layers), config.max_loras, config.max_lora_rank, config.max_cpu_loras)

    # -- host copies ---------------------------------------------------------------------

    def add(self, request: LoRARequest, keep: frozenset[int] = frozenset()) -> bool:
        """Read and check the adapter into the host cache (LoRALoadError if it cannot be
        applied); False if it was there already. `keep`: ids not to evict (this step's)."""
        if request.lora_int_id in self.host:
            self.host.move_to_end(request.lora_int_id)
            return False
        started = time.perf_counter()
        weights = read_adapter(request, self.targets, self.config.max_lora_rank)
        self.load_seconds[request.lora_int_id] = time.perf_counter() - started
        while len(self.host) >= self.config.max_cpu_loras:
            victim = next((i for i in self.host if i not in keep), None)
            if victim is None:
                break
            self._drop(victim)
        self.host[request.lora_int_id] = weights
        log.info("LoRA adapter %r (id %d) read from %s in %.3f s: %d modules, rank %d",
                 request.lora_name, request.lora_int_id, request.lora_path,
                 self.load_seconds[request.lora_int_id], len(weights.modules), weights.rank)
        return True

    def remove(self, lora_int_id: int) -> bool:
        if lora_int_id not in self.host and lora_int_id not in self.slots:
            return False
        self._drop(lora_int_id)
        return True

    def _drop(self, lora_int_id: int) -> None:
        self.host.pop(lora_int_id, None)
        for s, held in enumerate(self.slots):
            if held == lora_int_id:
                self.slots[s] = None

    def list(self) -> list[int]:
        return list(self.host)

    # -- device slots --------------------------------------------------------------------

    def _slot_for(self, request: LoRARequest, needed: set[int]) -> int:
        lid = request.lora_int_id
        if lid in self.slots:
            return self.slots.index(lid)
        free = [s for s, held in enumerate(self.slots) if held is None]
        idle = [s for s, held in enumerate(self.slots) if held not in needed]
        if not free and not idle:
            raise RuntimeError(f"LoRA: a step needs more than --max-loras "
                               f"{self.config.max_loras} adapters (the scheduler bounds it)")
        slot = free[0] if free else min(idle, key=lambda s: self._slot_used[s])
        self.add(request, frozenset(needed))
        weights = self.host[lid]
        for name, layer in self.layers.items():
            m = weights.modules.get(name)
            layer.set_slot(slot, None if m is None else m.a.to(self.device),
                           None if m is None else m.b.to(self.device),
                           0.0 if m is None else m.scaling)
        self.slots[slot] = lid
        return slot

    def batch(self, rows: list[LoRARequest | None], lens: list[int]) -> LoRABatch | None:
        """This step's LoRABatch for the scheduled rows (their adapters and token counts), or
        None when every row is a base row."""
        self._step += 1
        needed = {r.lora_int_id for r in rows if r is not None}
        if not needed:
            return None
        spans: dict[int, list[tuple[int, int]]] = {}
        offset = 0
        for req, n in zip(rows, lens, strict=True):
            if req is not None:
                slot = self._slot_for(req, needed)
                self._slot_used[slot] = self._step
                spans.setdefault(slot, []).append((offset, offset + n))
            offset += n
        groups = []
        contiguous = True
        for slot, ranges in spans.items():
            merged = [list(ranges[0])]
            for a, b in ranges[1:]:
                if a == merged[-1][1]:
                    merged[-1][1] = b
                else:
                    merged.append([a, b])
            if len(merged) == 1:
                groups.append((slot, slice(merged[0][0], merged[0][1])))
            else:
                contiguous = False
                idx = torch.cat([torch.arange(a, b) for a, b in merged]).to(self.device)
                groups.append((slot, idx))
        if len(groups) == 1 and contiguous:  # one adapter's rows in one run: a slice
            return LoRABatch(groups)
        row_slot, mask = dense_parts(spans, offset, len(self.slots), self.config.max_lora_rank,
                                     self.device)
        return LoRABatch(groups, row_slot, mask)
