"""Engine-core test helpers: cheap engines, and a block-leak check after every test.

Every LLM or EngineCore made through `make_llm` / `make_engine` is checked after each test
(autouse `no_block_leaks`): no unfinished requests and every usable KV block back in the free
pool, also after aborts and preemptions.
"""

from __future__ import annotations

import weakref

import pytest
import torch


def per_request(step) -> list:
    """A StepOutput as one EngineCoreOutput per request that produced something (its decode
    columns as one-token outputs, first): the form these tests compare; the engine never
    builds it."""
    from shoal.engine.wire import EngineCoreOutput

    columns = [EngineCoreOutput(r, [t]) for r, t in
               zip(step.decode_req_ids, step.decode_token_ids, strict=True) if r is not None]
    return columns + list(step.outputs)


# Small budgets keep each engine's KV allocation (zeroed memory) cheap on a shared machine.
TEST_KV_BYTES = 32 << 20
_live_engines: weakref.WeakSet = weakref.WeakSet()


def _core_of(obj):
    return getattr(obj, "engine_core", obj)


def assert_no_leaks(engine) -> None:
    core = _core_of(engine)
    if core is None:  # shut down
        return
    sched = core.scheduler
    assert not sched.has_unfinished_requests(), f"unfinished requests left: {sched.requests}"
    pool = sched.kv.pool
    assert pool.num_free_blocks == pool.num_blocks - 1, (
        f"KV block leak: {pool.num_blocks - 1 - pool.num_free_blocks} blocks still held "
        f"by {list(sched.kv.req_blocks)}")
    assert not sched.kv.req_blocks


@pytest.fixture(autouse=True)
def no_block_leaks():
    yield
    for engine in list(_live_engines):
        assert_no_leaks(engine)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # Two cores shared by several test processes: one intra-op thread avoids oversubscription.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def make_llm():
    from shoal.engine.llm import LLM

    made = []

    def make(model: str, **engine_args):
        engine_args.setdefault("kv_cache_memory_bytes", TEST_KV_BYTES)
        engine_args.setdefault("max_model_len", 512)
        llm = LLM(model, **engine_args)
        _live_engines.add(llm)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.shutdown()


@pytest.fixture(scope="module")
def make_engine():
    from shoal.engine.config import EngineConfig
    from shoal.engine.core.engine_core import EngineCore

    made = []

    def make(model: str, **engine_args):
        engine_args.setdefault("kv_cache_memory_bytes", TEST_KV_BYTES)
        engine_args.setdefault("max_model_len", 512)
        core = EngineCore(EngineConfig(model=model, **engine_args))
        _live_engines.add(core)
        made.append(core)
        return core

    yield make
    for core in made:
        core.shutdown()
