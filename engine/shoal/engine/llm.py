"""Offline API with vLLM's names and shapes: `LLM(model=..., **engine_args)`,
`llm.generate(prompts, sampling_params)` and `llm.chat(messages, sampling_params)` return a
list of RequestOutput, each with `n` CompletionOutputs (the dataclasses below).

The engine runs in this process (InprocClient); the request goes through the same front half as
the HTTP server's: the InputProcessor (validation, the model's extra end tokens, max_tokens up to
the context) and the OutputProcessor (incremental detokenization, stop strings), so the text is
the server's. `generate` submits every prompt (n engine requests each, seeds stepping by choice
as the server's do) at once and steps the engine until all finish, so they batch together.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from dataclasses import dataclass, field

import msgspec
from shoal.engine import wire
from shoal.engine.config import EngineConfig

# vLLM `LLM(...)` arguments that mean nothing here, and the values accepted: this engine never
# captures CUDA graphs (always eager) and runs no remote code.
NO_OP_ARGS = {"enforce_eager": (True, False), "trust_remote_code": (False,)}
_DERIVED = {"architectures", "model_max_len"}  # EngineConfig fields set from config.json
logger = logging.getLogger("shoal.engine.llm")


@dataclass
class Logprob:
    """One token's log-probability at one position (vLLM's Logprob)."""

    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


def _position_dict(pos) -> dict[int, Logprob]:
    """vLLM's per-position dict: the chosen token (with its rank) and the top-N alternatives."""
    out = {pos.token_id: Logprob(pos.logprob, pos.rank, pos.token)}
    for rank, (tid, value, text) in enumerate(
            zip(pos.token_ids[1:], pos.logprobs[1:], pos.tokens[1:], strict=True), start=1):
        out.setdefault(tid, Logprob(value, rank, text))
    return out


@dataclass
class CompletionOutput:
    """One sampled completion of a request (vLLM's CompletionOutput)."""

    index: int  # which of the request's n completions
    text: str
    token_ids: list[int]
    # With SamplingParams.logprobs: the sum of the chosen tokens' logprobs, and per token a dict
    # token id -> Logprob (the chosen token and the top-N alternatives), as vLLM's.
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One prompt's outputs (vLLM's RequestOutput); `prompt` is None for token-id prompts."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    # With SamplingParams.prompt_logprobs: None for the first prompt token, then a dict per token.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first choice)


# vLLM's names of EngineConfig's fields, as LLM() takes them.
_VLLM_NAMES = {"num_gpu_blocks_override": "num_kv_blocks"}


_LORA_ARGS = ("max_loras", "max_lora_rank", "max_cpu_loras")


def _lora_args(kwargs: dict) -> dict:
    """vLLM's enable_lora, max_loras, max_lora_rank, max_cpu_loras -> lora_config."""
    enable = kwargs.pop("enable_lora", False)
    given = {k: kwargs.pop(k) for k in _LORA_ARGS if k in kwargs}
    if not enable:
        if given:
            raise TypeError(f"LLM() got {sorted(given)} without enable_lora=True")
        return kwargs
    from shoal.engine.lora.config import LoRAConfig

    return {**kwargs, "lora_config": LoRAConfig(**given)}


def _engine_args(kwargs: dict) -> dict:
    """EngineConfig's arguments out of LLM's (vLLM's names translated); a vLLM argument this
    engine does not implement (or a no-op one with a value that would mean something) is a
    TypeError naming it."""
    kwargs = _lora_args(dict(kwargs))
    for vllm_name, name in _VLLM_NAMES.items():
        if vllm_name in kwargs:
            if name in kwargs:
                raise TypeError(f"LLM() got both {vllm_name} and {name}; pass one")
            kwargs = {(name if k == vllm_name else k): v for k, v in kwargs.items()}
    known = {f.name for f in dataclasses.fields(EngineConfig)} - _DERIVED
    unknown = sorted(k for k in kwargs if k not in known and k not in NO_OP_ARGS)
    bad = sorted(f"{k}={kwargs[k]!r}" for k in NO_OP_ARGS
                 if k in kwargs and kwargs[k] not in NO_OP_ARGS[k])
    if unknown or bad:
        raise TypeError(f"LLM() got argument(s) this engine does not implement: "
                        f"{', '.join(unknown + bad)}; it takes {sorted(known)} and, as no-ops, "
                        f"{sorted(NO_OP_ARGS)}.")
    return {k: v for k, v in kwargs.items() if k not in NO_OP_ARGS}


def _priority_to_seq(priority: int | list[int] | None, num_requests: int) -> list[int]:
    """One priority per prompt, as vLLM's offline API spreads them (and its error)."""
    if priority is None:
        return [0] * num_requests
    if isinstance(priority, (list, tuple)):
        if len(priority) != num_requests:
            raise ValueError(f"The lengths of prompts ({num_requests}) and priority "
                             f"({len(priority)}) must be the same.")
        return list(priority)
    return [priority] * num_requests


class LLM:
    def __init__(self, model: str, *, tokenizer: str | None = None,
                 generation_config: str = "auto", scheduling_policy: str = "fcfs",
                 revision: str | None = None, tokenizer_revision: str | None = None,
                 download_dir: str | None = None, hf_token: str | bool | None = None,
                 **kwargs) -> None:
        """`generation_config`: vLLM's: "auto" takes the model's generation_config.json
        sampling values as the defaults of a call without SamplingParams
        (`get_default_sampling_params`), "vllm" ignores them, a directory reads its file.
        `scheduling_policy`: vLLM's, "fcfs" or "priority" (generate's and chat's `priority`).
        `model` and `tokenizer` may be hub ids, resolved as `shoal serve` resolves them
        (model_files.py: the Hugging Face cache or `download_dir` at `revision`, else the hub);
        one that is not there raises ResolveError naming id, revision and cache."""
        from shoal.engine.core_client.inproc import InprocClient
        from shoal.engine.frontend.async_llm import _extra_eos_ids
        from shoal.engine.frontend.input_processor import InputProcessor
        from shoal.engine.generation_config import describe, sampling_defaults
        from shoal.engine.model_files import resolve
        from shoal.engine.tokenizer import load_tokenizer

        hub = dict(download_dir=download_dir, token=hf_token)
        found = resolve(model, revision=revision, **hub)
        logger.info("%s", found.how)
        model = found.path
        if tokenizer:
            found = resolve(tokenizer, revision=tokenizer_revision or revision,
                            what="tokenizer", **hub)
            logger.info("%s", found.how)
            tokenizer = found.path
        self.config = EngineConfig(model=model, **_engine_args(kwargs))
        self.default_sampling_params = sampling_defaults(model, generation_config)
        if self.default_sampling_params:
            logger.info("%s", describe(self.default_sampling_params, generation_config))
        self.tokenizer = load_tokenizer(tokenizer or model)
        self.client = InprocClient(self.config, scheduling_policy)
        core = self.client.engine_core
        self.input_processor = InputProcessor(
            self.tokenizer, max_model_len=core.max_model_len,
            vocab_size=core.vocab_size or len(self.tokenizer),
            extra_eos_token_ids=_extra_eos_ids(model), scheduling_policy=scheduling_policy)
        self._ids = itertools.count()
        # Totals over every step this LLM ran (from SchedulerStats), for tests and benchmarks.
        self.stats = {"steps": 0, "num_preemptions": 0, "prefix_cache_queries": 0,
                      "prefix_cache_hits": 0}

    @property
    def engine_core(self):
        return self.client.engine_core

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> wire.SamplingParams:
        """What a call without SamplingParams samples with: the model's generation_config
        values over vLLM's defaults (vLLM's LLM.get_default_sampling_params)."""
        from shoal.engine.sampling_params import SamplingParams

        return SamplingParams(**self.default_sampling_params)

    def _prompt(self, prompt) -> tuple[str | None, list[int]]:
        """(text, token ids) of a string, a token-id list, or vLLM's {"prompt": ...} /
        {"prompt_token_ids": ...} dicts."""
        if isinstance(prompt, dict):
            extra = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
            if extra or len(prompt) != 1:
                raise ValueError(f"a prompt dict takes exactly one of 'prompt' or "
                                 f"'prompt_token_ids'; got keys {sorted(prompt)}.")
            prompt = prompt.get("prompt", prompt.get("prompt_token_ids"))
        if isinstance(prompt, str):
            return prompt, self.input_processor.tokenize(prompt)
        return None, list(prompt)

    def generate(self, prompts, sampling_params: wire.SamplingParams | list | None = None, *,
                 use_tqdm: bool = True, priority: int | list[int] | None = None,
                 lora_request: wire.LoRARequest | list | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt; outputs in prompt order. `use_tqdm` is accepted for vLLM's
        signature; no progress bar is drawn. `priority`: one for all prompts or one each (vLLM's;
        other than 0 only with scheduling_policy="priority"). `lora_request`: vLLM's
        LoRARequest(name, int_id, path) for all prompts, or one each (None = the base model),
        with enable_lora=True. A bad prompt, parameter or adapter raises ValueError before
        anything is submitted."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run([self._prompt(p) for p in prompts], sampling_params, priority,
                         lora_request)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: wire.SamplingParams | list | None = None, *,
             add_generation_prompt: bool = True, use_tqdm: bool = True,
             priority: int | list[int] | None = None) -> list[RequestOutput]:
        """Generate a reply to one conversation (a list of {"role", "content"}) or to each of
        several, through the model's chat template (as the server's /v1/chat/completions)."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        rendered = []
        for conv in conversations:
            ids = self.input_processor.render_chat(conv, add_generation_prompt)
            text = self.tokenizer.apply_chat_template(conv, add_generation_prompt, tokenize=False)
            rendered.append((text, ids))
        return self._run(rendered, sampling_params, priority)

    def _run(self, prompts: list[tuple[str | None, list[int]]], sampling_params,
             priority: int | list[int] | None = None, lora_request=None) -> list[RequestOutput]:
        from shoal.engine.frontend.output_processor import OutputProcessor

        if not prompts:
            return []
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = (sampling_params if isinstance(sampling_params, list)
                  else [sampling_params] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params.")
        priorities = _priority_to_seq(priority, len(prompts))
        loras = (list(lora_request) if isinstance(lora_request, (list, tuple))
                 else [lora_request] * len(prompts))
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(loras)} lora requests.")
        for lora in {id(x): x for x in loras if x is not None}.values():
            self.client.engine_core.add_lora(lora)  # a bad adapter fails here, before any add
        op = OutputProcessor(self.tokenizer)
        results, requests, slots = [], [], {}
        for (text, ids), sp, prio, lora in zip(prompts, params, priorities, loras, strict=True):
            sp.verify()
            rid = str(next(self._ids))
            res = RequestOutput(rid, text, ids, [CompletionOutput(j, "", []) for j in range(sp.n)])
            results.append(res)
            for out in res.outputs:  # validate all first: a bad prompt submits nothing
                p = msgspec.structs.replace(sp, n=1, seed=None if sp.seed is None
                                            else sp.seed + out.index)
                req = self.input_processor.process(f"{rid}-{out.index}", ids, p, prio, lora)
                requests.append(req)
                slots[req.request_id] = (res, out, op.add_request(
                    req.request_id, req.request_id, len(ids), req.sampling_params))
        added = []
        try:
            for req in requests:
                self.client.add_request(req)
                added.append(req.request_id)
            while op.request_states:
                step = self.client.get_output()
                to_abort = (op.process_tokens(step.decode_req_ids, step.decode_token_ids)
                            + op.process_outputs(step.outputs))
                if to_abort:  # stop strings, found here
                    self.client.abort_requests(to_abort)
                self._count(step.scheduler_stats)
                self._collect(slots)
        except BaseException:
            self.client.abort_requests([r for r in added if r in op.request_states])
            raise
        for res in results:
            res.finished = all(o.finished() for o in res.outputs)
        return results

    @staticmethod
    def _collect(slots: dict) -> None:
        for engine_id, (res, out, collector) in list(slots.items()):
            delta = collector.get_nowait()
            if delta is None:
                continue
            out.text += delta.text
            out.token_ids += delta.token_ids
            if delta.logprobs is not None:
                out.logprobs = (out.logprobs or []) + [_position_dict(p) for p in delta.logprobs]
                out.cumulative_logprob = ((out.cumulative_logprob or 0.0)
                                          + sum(p.logprob for p in delta.logprobs))
            if out.index == 0 and delta.prompt_logprobs is not None:
                res.prompt_logprobs = [None if p is None else _position_dict(p)
                                       for p in delta.prompt_logprobs]
            if out.index == 0 and delta.num_cached_tokens:
                res.num_cached_tokens = delta.num_cached_tokens
            if delta.finished:
                out.finish_reason, out.stop_reason = delta.finish_reason, delta.stop_reason
                del slots[engine_id]

    def _count(self, stats: wire.SchedulerStats | None) -> None:
        if stats is None:
            return
        self.stats["steps"] += 1
        self.stats["num_preemptions"] += stats.num_preemptions
        self.stats["prefix_cache_queries"] += stats.prefix_cache_queries
        self.stats["prefix_cache_hits"] += stats.prefix_cache_hits

    def get_kv_stats(self) -> dict:
        return self.client.call_utility("get_kv_stats")

    def shutdown(self) -> None:
        self.client.shutdown()
