"""Offline API: `LLM(model, **engine_args).generate(prompts, sampling_params)`.

The LLM owns the tokenizer (the engine only sees token ids) and an EngineCoreClient
(InprocClient: the engine runs in this process). `generate` submits every prompt at once and
steps the engine until all are finished, so they are batched together.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from shoal.engine import wire
from shoal.engine.config import EngineConfig


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class LLM:
    def __init__(self, model: str, *, tokenizer: str | None = None, **engine_args) -> None:
        from shoal.engine.core_client import InprocClient
        from transformers import AutoTokenizer

        self.config = EngineConfig(model=model, **engine_args)
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer or model)
        self.client = InprocClient(self.config)
        self._ids = itertools.count()
        # Totals over every step this LLM ran (from SchedulerStats), for tests and benchmarks.
        self.stats = {"steps": 0, "num_preemptions": 0, "prefix_cache_queries": 0,
                      "prefix_cache_hits": 0}

    @property
    def engine_core(self):
        return self.client.engine_core

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer(prompt).input_ids
        return list(prompt)

    def generate(
        self,
        prompts: str | list[int] | list[str | list[int]],
        sampling_params: wire.SamplingParams | list[wire.SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (strings or token-id lists); outputs in prompt order.

        A bad prompt or parameter raises ValueError before anything is submitted."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            return []
        if sampling_params is None:
            sampling_params = wire.SamplingParams()
        params = (sampling_params if isinstance(sampling_params, list)
                  else [sampling_params] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params.")
        requests = [
            wire.EngineCoreRequest(f"llm-{next(self._ids)}", self._tokenize(p), sp, time.time(),
                                   self.tokenizer.eos_token_id)
            for p, sp in zip(prompts, params, strict=True)
        ]
        for req in requests:  # validate all first: a bad prompt submits nothing
            self._validate(req)
        results = {r.request_id: RequestOutput(r.request_id, r.prompt_token_ids) for r in requests}
        added = []
        try:
            for req in requests:
                self.client.add_request(req)
                added.append(req.request_id)
            while any(not o.finished for o in results.values()):
                outputs = self.client.get_output()
                self._collect(outputs, results)
                self._count(outputs.scheduler_stats)
        except BaseException:
            self.client.abort_requests(added)
            raise
        for out, req in zip(results.values(), requests, strict=True):
            out.text = self.tokenizer.decode(
                out.token_ids, skip_special_tokens=req.sampling_params.skip_special_tokens)
        return list(results.values())

    def _validate(self, req: wire.EngineCoreRequest) -> None:
        req.sampling_params.verify()
        if req.sampling_params.n != 1:
            raise ValueError(f"LLM.generate takes n=1, got n={req.sampling_params.n}; repeat the "
                             "prompt (with different seeds) for several samples.")
        core = self.client.engine_core
        if not req.prompt_token_ids:
            raise ValueError("a prompt is empty; send at least one token.")
        if len(req.prompt_token_ids) >= core.max_model_len:
            raise ValueError(f"a prompt has {len(req.prompt_token_ids)} tokens but the context "
                             f"length (max_model_len) is {core.max_model_len}; shorten it.")

    def _count(self, stats: wire.SchedulerStats | None) -> None:
        if stats is None:
            return
        self.stats["steps"] += 1
        self.stats["num_preemptions"] += stats.num_preemptions
        self.stats["prefix_cache_queries"] += stats.prefix_cache_queries
        self.stats["prefix_cache_hits"] += stats.prefix_cache_hits

    @staticmethod
    def _collect(outputs: wire.EngineCoreOutputs, results: dict[str, RequestOutput]) -> None:
        for o in outputs.outputs:
            res = results.get(o.request_id)
            if res is None:
                continue
            if o.new_token_ids and not res.token_ids:
                res.num_cached_tokens = o.num_cached_tokens
            res.token_ids.extend(o.new_token_ids)
            if o.finish_reason is not None:
                res.finish_reason = str(o.finish_reason)
                res.stop_reason = o.stop_reason

    def get_kv_stats(self) -> dict:
        return self.client.call_utility("get_kv_stats")

    def shutdown(self) -> None:
        self.client.shutdown()
