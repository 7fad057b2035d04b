"""StructuredOutputManager: the grammar matchers of one EngineCore (vLLM V1's design).

- `submit` (from add_request): the request's grammar compiles on a thread pool, never on the
  engine's busy loop; until it is ready the scheduler leaves the request waiting and schedules
  the others (`is_ready`).
- `fill_bitmask` (from the scheduler, for the constrained rows that sample this step): one packed
  int32 bitmask, which travels with the SchedulerOutput to every rank.
- `accept` (from update_from_output): the sampled token advances the matcher; True once the
  grammar is complete, and the request finishes with finish_reason "stop".

The llguidance tokenizer is built once, from the model's tokenizer.json, on the pool (about a
second for a large vocabulary), the first time a constrained request arrives.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import numpy as np
from shoal.engine.structured import spec
from shoal.engine.wire import StructuredOutputs

log = logging.getLogger(__name__)


@dataclass
class GrammarState:
    """One request's grammar: compiling (future), then a matcher."""

    future: Future
    matcher: object | None = None  # llguidance.LLMatcher once compiled
    error: str | None = None  # why the compile failed
    num_accepted: int = field(default=0)


class StructuredOutputManager:
    def __init__(self, model_dir: str, vocab_size: int, max_workers: int | None = None) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        workers = max_workers or max(1, min(4, (os.cpu_count() or 2) // 2))
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="grammar-compile")
        self._tokenizer = None
        self._tokenizer_lock = threading.Lock()
        self._executor = None
        self._compiling: set[Future] = set()

    # -- compile (off the busy loop) ---------------------------------------------------------

    @staticmethod
    def validate(so: StructuredOutputs) -> None:
        """ValueError (the library's message) if the grammar does not compile; cheap, no
        tokenizer: add_request calls it so a bad spec is refused (400) before it is queued."""
        spec.check(so)

    def submit(self, request) -> None:
        future = self._pool.submit(self._compile, request.sampling_params.structured_outputs,
                                   request.request_id)
        self._compiling.add(future)
        request.grammar = GrammarState(future)

    def _llg_tokenizer(self):
        with self._tokenizer_lock:
            if self._tokenizer is None:
                import llguidance
                from shoal.engine.tokenizer import FastTokenizer

                tok = FastTokenizer(self.model_dir)
                self._tokenizer = llguidance.LLTokenizer(
                    tok.backend_tokenizer.to_str(), n_vocab=self.vocab_size,
                    eos_token=tok.eos_token_id)
                self._executor = llguidance.LLExecutor()
                log.info("structured output: llguidance tokenizer built from %s (%d tokens)",
                         self.model_dir, self.vocab_size)
            return self._tokenizer

    def _compile(self, so: StructuredOutputs, request_id: str):
        import llguidance

        matcher = llguidance.LLMatcher(self._llg_tokenizer(), spec.to_grammar(so))
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        log.info("request %s: %s grammar compiled", request_id, so.kind)
        return matcher

    def is_ready(self, request) -> bool:
        """True once the grammar compiled (or failed: `grammar.error` then says why)."""
        state: GrammarState = request.grammar
        if state.matcher is not None or state.error is not None:
            return True
        if not state.future.done():
            return False
        self._compiling.discard(state.future)
        try:
            state.matcher = state.future.result()
        except Exception as exc:  # noqa: BLE001 - the request fails, the engine goes on
            state.error = str(exc) or type(exc).__name__
            log.warning("request %s: grammar compile failed: %s", request.request_id, state.error)
        return True

    def num_compiling(self) -> int:
        self._compiling = {f for f in self._compiling if not f.done()}
        return len(self._compiling)

    def wait_for_compile(self, timeout: float) -> None:
        """Block until some grammar finishes compiling, or `timeout`: an engine with nothing
        else to do sleeps here instead of spinning."""
        if self._compiling:
            wait(list(self._compiling), timeout=timeout, return_when="FIRST_COMPLETED")

    # -- each step ----------------------------------------------------------------------------

    def fill_bitmask(self, requests: list) -> bytes:
        """The packed bitmask (int32 little-endian, one row per request, in order)."""
        from llguidance.numpy import fill_next_token_bitmask_par

        mask = np.full((len(requests), self.words), -1, dtype=np.int32)
        fill_next_token_bitmask_par(
            self._executor, [(r.grammar.matcher, i) for i, r in enumerate(requests)], mask)
        return mask.astype("<i4", copy=False).tobytes()

    def accept(self, request, token: int) -> bool:
        """Advance the request's matcher by its sampled token; True if the grammar is done."""
        matcher = request.grammar.matcher
        if not matcher.consume_token(token):
            log.warning("request %s: token %d rejected by its grammar: %s", request.request_id,
                        token, matcher.get_error())
            return True
        request.grammar.num_accepted += 1
        return matcher.is_stopped()

    @staticmethod
    def free(request) -> None:
        state = getattr(request, "grammar", None)
        if state is not None:
            state.future.cancel()
            request.grammar = None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
