"""ModelRunner: runs transformers' own model class over one packed batch per step.

It owns the model, the paged KV cache tensors and the per-request sampling state. Each step it
turns a SchedulerOutput (token ids, positions, block tables) into one forward pass over every
scheduled token of every request, then samples one token for each request that reached the end
of its known tokens.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from shoal.engine import wire
from shoal.engine.config import EngineConfig, check_model_readable
from shoal.engine.core.sched_output import ModelRunnerOutput, SchedulerOutput
from shoal.engine.errors import UnsupportedModelError
from shoal.engine.lora import layers as lora_layers
from shoal.engine.worker import (
    kv_sizing,
    logprobs,
    model_check,
    paged_attention,
    tensor_parallel,
)
from shoal.engine.worker.cpu.backend import CpuBackend, cpu_has_native_bf16
from shoal.engine.worker.input_batch import CachedRequestState, build_sampling_metadata
from shoal.engine.worker.kv_memory import KvArena
from shoal.engine.worker.paged_attention import PagedAttentionMetadata, PrefillChunk
from shoal.engine.worker.sampler import apply_grammar_bitmask, sample

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(requested: str, hf_config, device: torch.device) -> torch.dtype:
    """`--dtype auto` as vLLM resolves it: the checkpoint's own dtype, except that float32
    checkpoints run in the device's preferred half type (bfloat16 on CUDA with bf16 support, else
    float16; bfloat16 on CPUs that compute it natively: AVX512-BF16 or AMX). Unlike vLLM, a CPU
    without native bf16 keeps float32, where bf16 would be emulated and slower."""
    if requested != "auto":
        return _DTYPES[requested]
    own = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(own, str):
        own = _DTYPES.get(own)
    if not isinstance(own, torch.dtype):
        own = torch.float32
    if own != torch.float32:
        return own
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "cpu" and cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


class ModelRunner:
    """One rank's model. With tensor_parallel_size T > 1 it holds this rank's shard of every
    layer (tensor_parallel.py) and a KV cache for its local KV heads; torch.distributed must be
    initialised (default group = the T ranks) before load_model(). Every rank computes the same
    full logits and samples with the same seeds, so all ranks sample the same tokens."""

    def __init__(self, config: EngineConfig, device: torch.device, rank: int = 0) -> None:
        self.config = config
        self.device = device
        self.rank = rank
        self.world_size = config.tensor_parallel_size
        self.block_size = config.block_size
        self.model = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.kv_arena: KvArena | None = None  # the CPU cache's memory (kv_memory.py)
        self.states: dict[str, CachedRequestState] = {}
        self._gather_bufs: tuple[torch.Tensor, torch.Tensor] | None = None
        self.cpu: CpuBackend | None = None  # the CPU backend's hook (worker/cpu/), at load
        self.lora = None  # LoRAManager with --enable-lora (lora/manager.py), at load
        self.generator = torch.Generator(device=device).manual_seed(config.seed)
        # prompt_logprobs requests whose first token is not sampled yet -> the prompt's rows
        # gathered so far, as (first position, rows) per chunk. Empty: no extra work per step.
        self.prompt_lp_parts: dict[str, list[tuple[int, wire.Logprobs]]] = {}

    # -- set-up --------------------------------------------------------------------------

    def load_model(self) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        check_model_readable(self.config.model)
        hf_config = AutoConfig.from_pretrained(self.config.model)
        try:
            model_cls = AutoModelForCausalLM._model_mapping[type(hf_config)]
        except KeyError:
            raise UnsupportedModelError(f"unsupported architecture {hf_config.architectures} "
                             f"(model_type {hf_config.model_type!r}): transformers has no causal "
                             "LM class for it.") from None
        if not getattr(model_cls, "_supports_attention_backend", False):
            raise UnsupportedModelError(
                f"unsupported architecture {model_cls.__name__}: its transformers "
                "implementation does not route attention through AttentionInterface, "
                "so shoal cannot plug in its paged KV cache.")
        name = f"{self.config.model} ({model_cls.__name__})"
        text_cfg = hf_config.get_text_config()
        model_check.check_config(text_cfg, name)  # before any weight is loaded
        if self.world_size > 1:  # refuse a T that does not split the model before loading it
            tensor_parallel.check_shardable(text_cfg, self.world_size, name)
        self.dtype = resolve_dtype(self.config.dtype, hf_config, self.device)
        model = AutoModelForCausalLM.from_pretrained(
            self.config.model, dtype=self.dtype,
            attn_implementation=paged_attention.ATTN_IMPLEMENTATION,
        )
        text_cfg = model.config.get_text_config()
        if self.world_size > 1:  # on the host, so the device only ever holds this rank's share
            tensor_parallel.shard_model(model, self.rank, self.world_size, name)
        self.model = model.to(self.device).eval()
        self.cpu = CpuBackend(self.device, self.dtype)
        self.cpu.prepare(self.model)
        # The cache's geometry is what the layers really produce (this rank's heads under TP).
        with self.cpu.active():
            layout = model_check.probe_model(self.model, text_cfg, self.device, name)
        self.cpu.probed()
        self.num_layers, self.num_kv_heads = layout.num_layers, layout.num_kv_heads
        self.head_dim = layout.head_dim
        self.vocab_size = text_cfg.vocab_size
        log.info("loaded %s (%s, %s) on %s, tensor-parallel rank %d of %d: %s", self.config.model,
                 model_cls.__name__, self.dtype, self.device, self.rank, self.world_size,
                 layout.describe())
        self.cpu.load_decode_kernel(self.head_dim, self.block_size, layout.num_heads,
                                    self.num_kv_heads)
        if self.config.lora_config is not None:  # after the probes: they run the base layers
            from shoal.engine.lora.manager import LoRAManager

            self.lora = LoRAManager(self.model, self.config.lora_config, self.device)

    # -- LoRA adapters (--enable-lora) ----------------------------------------------------

    def add_lora(self, request: wire.LoRARequest) -> bool:
        return self._lora().add(request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self._lora().remove(lora_int_id)

    def list_loras(self) -> list[int]:
        return self._lora().list()

    def _lora(self):
        if self.lora is None:
            raise ValueError("LoRA is not enabled: start the engine with --enable-lora "
                             "(enable_lora=True)")
        return self.lora

    def kv_bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    @torch.inference_mode()
    def profile_run(self, measure=contextlib.nullcontext) -> None:
        """One step of vLLM's profile batch (kv_sizing.profile_schedule) over a cache just big
        enough for it, inside `measure()` (the worker's memory meter, entered once that cache
        exists so it is not counted as activations); then the cache and the requests are gone."""
        cfg = self.config
        sched, num_blocks = kv_sizing.profile_schedule(
            cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.max_model_len, self.block_size)
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        saved = self.kv_caches
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device))
                          for _ in range(self.num_layers)]
        try:
            with measure():
                self.execute_model(sched)
        finally:
            for rid in sched.req_ids:
                self.states.pop(rid, None)
            self.kv_caches = saved

    def initialize_kv_cache(self, num_blocks: int) -> None:
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        if self.device.type != "cpu":
            self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                               torch.zeros(shape, dtype=self.dtype, device=self.device))
                              for _ in range(self.num_layers)]
            return
        self.kv_arena = KvArena(num_blocks * self.kv_bytes_per_block(), self.rank)
        self.kv_caches = [(self.kv_arena.tensor(shape, self.dtype),
                           self.kv_arena.tensor(shape, self.dtype))
                          for _ in range(self.num_layers)]
        self.kv_arena.commit()

    # -- one step ------------------------------------------------------------------------

    def _update_states(self, sched: SchedulerOutput) -> None:
        for rid in sched.finished_req_ids:
            self.states.pop(rid, None)
            self.prompt_lp_parts.pop(rid, None)
        for new in sched.new_requests:
            gen = None
            if new.sampling_params.seed is not None:
                gen = torch.Generator(device=self.device).manual_seed(new.sampling_params.seed)
            self.states[new.req_id] = CachedRequestState(
                new.req_id, new.prompt_token_ids, new.sampling_params, new.eos_token_id, gen,
                lora_request=new.lora_request)
            if new.sampling_params.prompt_logprobs is not None and self.rank == 0:
                self.prompt_lp_parts[new.req_id] = []

    def _attention_metadata(self, sched: SchedulerOutput, lens: list[int]):
        dev, bs = self.device, self.block_size
        long = dict(dtype=torch.long, device=dev)
        max_blocks = max(len(b) for b in sched.block_ids)
        table = torch.tensor([b + [0] * (max_blocks - len(b)) for b in sched.block_ids], **long)
        starts = torch.tensor(sched.start_positions, **long)
        lens_t = torch.tensor(lens, **long)
        row_of_token = torch.repeat_interleave(torch.arange(len(lens), device=dev), lens_t)
        token_offsets = torch.cumsum(lens_t, 0) - lens_t
        positions = starts[row_of_token] + torch.arange(row_of_token.numel(), device=dev) \
            - token_offsets[row_of_token]
        slots = table[row_of_token, positions // bs] * bs + positions % bs

        decode_rows = [i for i, n in enumerate(lens) if n == 1]
        all_decode = len(decode_rows) == len(lens)
        decode_idx = decode_table = ctx = None
        if decode_rows:
            rows = torch.tensor(decode_rows, **long)
            ctx = starts[rows] + 1
            num_blocks = -(-max(sched.start_positions[i] + 1 for i in decode_rows) // bs)
            decode_idx = token_offsets[rows]
            decode_table = table[rows, :num_blocks].contiguous()
        prefills = []
        offset = 0
        for i, n in enumerate(lens):
            if n > 1:
                start = sched.start_positions[i]
                ids = None if start == 0 else table[i, : -(-(start + n) // bs)]
                prefills.append(PrefillChunk(offset, offset + n, ids, start + n))
            offset += n
        meta = PagedAttentionMetadata(slots, decode_idx, decode_table, ctx, all_decode,
                                      prefills, self.kv_caches)
        if self.cpu.decode_kernel is not None:
            meta.decode_kernel = self.cpu.decode_kernel
        elif decode_table is not None:
            meta.gather_buffers = self._gather_buffers(decode_table.numel())
        return meta, positions

    def _gather_buffers(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Persistent K/V gather destinations, grown (by 1.5x) when a step needs more rows."""
        if self._gather_bufs is None or self._gather_bufs[0].shape[0] < rows:
            width = self.block_size * self.num_kv_heads * self.head_dim
            n = max(rows, int(1.5 * (self._gather_bufs[0].shape[0] if self._gather_bufs else 0)))
            self._gather_bufs = tuple(torch.empty(n, width, dtype=self.dtype, device=self.device)
                                      for _ in range(2))
        return self._gather_bufs

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(sched)
        if not sched.req_ids:
            return ModelRunnerOutput()
        lens = [len(t) for t in sched.token_ids]
        flat = [t for toks in sched.token_ids for t in toks]
        input_ids = torch.tensor(flat, dtype=torch.long, device=self.device)
        meta, positions = self._attention_metadata(sched, lens)
        sample_rows = [i for i, s in enumerate(sched.sample) if s]
        ends = torch.cumsum(torch.tensor(lens, device=self.device), 0) - 1
        # Only rows that sample need logits; a step of prefill chunks alone projects one row.
        keep = ends[torch.tensor(sample_rows or [0], device=self.device)]
        prompt_rows = self._prompt_logprob_rows(sched, lens) if self.prompt_lp_parts else []
        n_sample_keep = keep.numel()
        if prompt_rows:  # prompt positions whose logits the asking requests need, after those
            extra = [torch.arange(o, o + n) for _, _, o, n in prompt_rows]
            keep = torch.cat([keep, torch.cat(extra).to(self.device)])
        lora_batch = None
        if self.lora is not None:
            lora_batch = self.lora.batch(
                [self.states[rid].lora_request for rid in sched.req_ids], lens)
        with self.cpu.active(), lora_layers.active(lora_batch):
            out = self.model(input_ids=input_ids[None], position_ids=positions[None],
                             logits_to_keep=keep, shoal_attn=meta, use_cache=False)
        result = ModelRunnerOutput()
        if prompt_rows:
            self._gather_prompt_logprobs(prompt_rows, out.logits[0, n_sample_keep:])
        if not sample_rows:
            return result
        logits = out.logits[0, :n_sample_keep]
        states = [self.states[sched.req_ids[i]] for i in sample_rows]
        if sched.grammar_req_ids:
            apply_grammar_bitmask(logits, [s.req_id for s in states], sched.grammar_req_ids,
                                  sched.grammar_bitmask)
        want = [j for j, s in enumerate(states) if s.params.logprobs is not None]
        # Before sample(): it edits float32 logits in place (bans); these are the raw values
        # (after the grammar's mask, as vLLM's raw logprobs are: a token the grammar forbids
        # has logprob -inf).
        raw = logprobs.raw_logprobs(logits[want]) if want and self.rank == 0 else None
        sampling = build_sampling_metadata(states, self.vocab_size, self.device)
        tokens_t = sample(logits, sampling, self.generator, self.cpu.argmax)
        tokens = tokens_t.tolist()
        for state, token in zip(states, tokens, strict=True):
            state.output_token_ids.append(token)
            result.sampled[state.req_id] = token
            if state.req_id in self.prompt_lp_parts:
                result.prompt_logprobs[state.req_id] = self._finish_prompt_logprobs(state)
        if raw is not None:
            rows = logprobs.pack_rows(raw, tokens_t[want],
                                      [states[j].params.logprobs for j in want])
            for j, lp in zip(want, rows, strict=True):
                result.logprobs[states[j].req_id] = lp
        return result

    # -- prompt logprobs (only requests that asked; rank 0 alone: its output is the group's) --

    def _prompt_logprob_rows(self, sched: SchedulerOutput, lens: list[int]):
        """(request id, first position, flat offset, count) for each scheduled chunk holding
        prompt positions whose next token is a prompt token: position p gives token p+1."""
        rows, offset = [], 0
        for rid, start, n in zip(sched.req_ids, sched.start_positions, lens, strict=True):
            parts = self.prompt_lp_parts.get(rid)
            if parts is not None:
                while parts and parts[-1][0] >= start:  # restarted (preempted): recompute
                    parts.pop()
                count = min(start + n, len(self.states[rid].prompt_token_ids) - 1) - start
                if count > 0:
                    rows.append((rid, start, offset, count))
            offset += n
        return rows

    def _gather_prompt_logprobs(self, prompt_rows, logits: torch.Tensor) -> None:
        raw = logprobs.raw_logprobs(logits)
        at = 0
        for rid, start, _, count in prompt_rows:
            state = self.states[rid]
            nxt = torch.tensor(state.prompt_token_ids[start + 1:start + 1 + count],
                               device=self.device)
            block = logprobs.pack_block(raw[at:at + count], nxt, state.params.prompt_logprobs)
            self.prompt_lp_parts[rid].append((start, block))
            at += count

    def _finish_prompt_logprobs(self, state: CachedRequestState) -> wire.Logprobs:
        parts = self.prompt_lp_parts.pop(state.req_id)
        n = len(state.prompt_token_ids) - 1
        covered = sum(len(p.ranks) // 4 for _, p in parts)
        if covered != n or (parts and parts[0][0] != 0):
            raise RuntimeError(f"request {state.req_id}: prompt logprobs cover {covered} of "
                               f"{n} positions (a prefix-cache hit skipped their logits)")
        if not parts:  # a one-token prompt: no position to report
            return wire.Logprobs(state.params.prompt_logprobs)
        return logprobs.concat([p for _, p in parts])
