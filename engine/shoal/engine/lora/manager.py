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
from shoal.engine.lora.layers import SHARED_INPUT, LoRABatch, LoRALinear, SharedInput, dense_mask
from shoal.engine.wire import LoRARequest
from torch import nn

log = logging.getLogger(__name__)

# What one more host-side op of a step (a call into torch, its dispatch, a kernel launch) costs,
# in FLOPs of the device's GEMM throughput, for segmented_pays: about 10 us against ~150 GFLOP/s
# of float32 on this project's 2-core CPUs; about 10 us of launch against tens of TFLOP/s on a
# GPU (benchmarks/README.md, LoRA adapters: where each form won).
OP_FLOPS = {"cpu": 2e6}
ACCELERATOR_OP_FLOPS = 5e8


def segmented_pays(*, tokens: int, slots: int, runs: int, gathered: bool, rank: int,
                   width: int, shared_inputs: int, layers: int, device_type: str) -> bool:
    """Whether a mixed step's segmented form costs less than its dense form: the FLOPs it
    saves (the dense form computes every slot for every token: `slots` times what each token
    needs) against the host ops it adds (per run: the A GEMM, a cast and a gather per shared
    input; the B GEMM and the write-back per layer). `width`: per token and rank column, the
    multiply-adds of every wrapped layer (each shared input's in_features times its members,
    plus every layer's out_features)."""
    saved = 2 * tokens * (slots - 1) * rank * width
    per_run = 3 * shared_inputs + 5 * layers if gathered else 2 * shared_inputs + 2 * layers
    added = runs * per_run - (3 * shared_inputs + 2 * layers)
    return saved > added * OP_FLOPS.get(device_type, ACCELERATOR_OP_FLOPS)


# The projections LoRA is applied to, as transformers' models name them.
TARGET_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def wrap_model(model: nn.Module, slots: int, max_rank: int, device) -> dict[str, LoRALinear]:
    """Wrap every projection named in TARGET_NAMES that is a linear layer (nn.Linear, or the
    CPU backend's packed one) in place; name -> wrapper, names as the model's own. Siblings of
    one SHARED_INPUT set with the same in_features share one SharedInput (one A GEMM)."""
    wrapped = {}
    for parent_name, parent in list(model.named_modules()):
        children = {n: c for n, c in parent.named_children()
                    if n in TARGET_NAMES and hasattr(c, "in_features")}
        sets = [[n for n in names if n in children] for names in SHARED_INPUT]
        sets = [m for m in sets if len({children[n].in_features for n in m}) == 1]
        alone = [[n] for n in children if not any(n in m for m in sets)]
        for members in sets + alone:
            shared = SharedInput(len(members), children[members[0]].in_features, slots,
                                 max_rank, device)
            for i, child_name in enumerate(members):
                layer = LoRALinear(children[child_name], slots, max_rank, device, shared, i)
                setattr(parent, child_name, layer)
                wrapped[f"{parent_name}.{child_name}" if parent_name else child_name] = layer
    return wrapped


class LoRAManager:
    def __init__(self, model: nn.Module, config: LoRAConfig, device) -> None:
        self.config = config
        self.device = device
        self.layers = wrap_model(model, config.max_loras, config.max_lora_rank, device)
        self.targets = {n: (m.in_features, m.out_features) for n, m in self.layers.items()}
        shared = {id(m.shared): m.shared for m in self.layers.values()}
        self._shape = dict(  # for segmented_pays
            width=sum(m.out_features for m in self.layers.values())
            + sum(sh.a_all.shape[1] * sh.members for sh in shared.values()),
            shared_inputs=len(shared), layers=len(self.layers), rank=config.max_lora_rank,
            slots=config.max_loras, device_type=torch.device(device).type)
        self.host: OrderedDict[int, LoRAWeights] = OrderedDict()  # LRU: oldest first
        self.slots: list[int | None] = [None] * config.max_loras  # adapter id per slot
        self._slot_used = [0] * config.max_loras  # step number of the slot's last use
        self._step = 0
        self._eye = torch.eye(config.max_loras + 1, config.max_loras)  # dense_mask's rows
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
        None when every row is a base row. One adapter whose rows are one run: a slice, no
        device tensor; else each token's slot, as one [tokens, slots] mask copied once."""
        self._step += 1
        slot_of: dict[int, int] = {}
        needed = {r.lora_int_id for r in rows if r is not None}
        if not needed:
            return None
        for req in rows:
            if req is not None and req.lora_int_id not in slot_of:
                slot = slot_of[req.lora_int_id] = self._slot_for(req, needed)
                self._slot_used[slot] = self._step
        base = len(self.slots)
        row_slot = []  # per row, then per token if the step needs the mask
        first = last = None
        offset = 0
        for req, n in zip(rows, lens, strict=True):
            row_slot.append(base if req is None else slot_of[req.lora_int_id])
            if req is not None:
                first = offset if first is None else first
                last = offset + n
            offset += n
        used = tuple(dict.fromkeys(s for s in row_slot if s != base))
        if len(used) == 1:
            adapted = sum(n for s, n in zip(row_slot, lens, strict=True) if s != base)
            if adapted == last - first:  # one adapter's rows in one run: a slice
                return LoRABatch(used[0], slice(first, last), None, used)
        per_token = row_slot if offset == len(rows) else [
            s for s, n in zip(row_slot, lens, strict=True) for _ in range(n)]
        spans = _spans(per_token, used)
        gathered = any(len(sp) > 1 for sp in spans.values())
        if segmented_pays(tokens=offset, runs=len(used), gathered=gathered, **self._shape):
            return LoRABatch(None, None, None, used, runs=self._runs(spans, gathered))
        return LoRABatch(None, None, dense_mask(per_token, base, self.device, self._eye), used)

    def _runs(self, spans: dict, gathered: bool) -> tuple:
        """The segmented form's (slot, rows) per adapter: slices when every adapter's tokens are
        one run; else index tensors, made on the host and copied to the device at once."""
        if not gathered:
            return tuple((slot, slice(*sp[0])) for slot, sp in spans.items())
        index = torch.tensor([i for sp in spans.values() for b, e in sp for i in range(b, e)],
                             dtype=torch.int64).to(self.device)
        out, at = [], 0
        for slot, sp in spans.items():
            n = sum(e - b for b, e in sp)
            out.append((slot, index[at:at + n]))
            at += n
        return tuple(out)


def _spans(per_token: list[int], used: tuple[int, ...]) -> dict[int, list[tuple[int, int]]]:
    """Each used slot's runs of tokens, [start, end) in order; by slot, ascending."""
    out: dict[int, list[tuple[int, int]]] = {s: [] for s in sorted(used)}
    start = 0
    for i in range(1, len(per_token) + 1):
        if i == len(per_token) or per_token[i] != per_token[start]:
            if per_token[start] in out:
                out[per_token[start]].append((start, i))
            start = i
    return out
