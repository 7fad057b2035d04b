"""LoRA adapters in the engine, exact against transformers + PEFT.

Adapters are made here with the real `peft` (LoraConfig on the project's tiny models, random
non-zero A and B so each adapter changes the output: asserted), saved with save_pretrained. The
greedy output of each adapter through Shoal (float32, the CPU fast paths on) equals
PeftModel.from_pretrained's greedy `generate`, each prompt alone, for the adapter alone and in
mixed batches (several adapters and the base in one step), with fewer device slots than
adapters (LRU eviction, the scheduler holding back a fourth adapter), and for a second
architecture (Qwen2: q/k/v biases). What cannot be applied is refused at load, naming it.
"""

from __future__ import annotations

import json

import pytest
import torch
from shoal.engine import wire
from shoal.engine.lora.request import LoRARequest

from tests.engine import lora_peft

MAX_NEW = 12
LENGTHS = [3, 16, 17, 40]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(5, 8192, (n,), generator=gen).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory) -> dict[str, str]:
    """Three adapters unlike each other: all seven projections at rank 8; attention only at
    rank 4 with rsLoRA; the MLP at rank 16 with a per-module rank (rank_pattern)."""
    d = tmp_path_factory.mktemp("lora")
    return {
        "all": lora_peft.make_adapter(tiny_model, d / "all", 1),
        "attn": lora_peft.make_adapter(tiny_model, d / "attn", 2, r=4, alpha=8,
                                       targets=["q_proj", "k_proj", "v_proj", "o_proj"],
                                       use_rslora=True),
        "mlp": lora_peft.make_adapter(tiny_model, d / "mlp", 3, r=16, alpha=32,
                                      targets=["gate_proj", "up_proj", "down_proj"],
                                      rank_pattern={"down_proj": 8}),
    }


@pytest.fixture(scope="module")
def references(tiny_model, adapters, prompts) -> dict[str | None, list[list[int]]]:
    refs = {name: lora_peft.reference(tiny_model, path, prompts, MAX_NEW)
            for name, path in adapters.items()}
    refs[None] = lora_peft.reference(tiny_model, None, prompts, MAX_NEW)
    return refs


def lora(adapters, name: str | None) -> LoRARequest | None:
    if name is None:
        return None
    return LoRARequest(name, 1 + sorted(adapters).index(name), adapters[name])


def greedy() -> wire.SamplingParams:
    return wire.SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_every_adapter_changes_the_output(references):
    base = references[None]
    for name in ("all", "attn", "mlp"):
        differ = sum(a != b for a, b in zip(references[name], base, strict=True))
        assert differ == len(base), f"adapter {name} leaves some outputs as the base model's"


@pytest.mark.parametrize("name", ["all", "attn", "mlp"])
def test_each_adapter_alone_equals_peft(name, make_llm, tiny_model, adapters, prompts,
                                        references):
    llm = make_llm(tiny_model, dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=16)
    outs = llm.generate(prompts, greedy(), lora_request=lora(adapters, name))
    assert tokens(outs) == references[name]


@pytest.mark.parametrize("slots", [4, 2])
def test_mixed_batch_equals_peft(slots, make_llm, tiny_model, adapters, prompts, references):
    """Every prompt with each of the three adapters and the base, all submitted at once: with 4
    slots they share steps; with 2 the scheduler runs at most two adapters per step and the
    slots are reused (LRU), a host cache of 2 reads one adapter again."""
    llm = make_llm(tiny_model, dtype="float32", enable_lora=True, max_loras=slots,
                   max_lora_rank=16, max_cpu_loras=slots)
    names = ["all", None, "attn", "mlp"]
    batch = [p for _ in names for p in prompts]
    loras = [lora(adapters, n) for n in names for _ in prompts]
    outs = tokens(llm.generate(batch, greedy(), lora_request=loras))
    want = [t for n in names for t in references[n]]
    assert outs == want
    manager = llm.engine_core.model_executor.worker.model_runner.lora
    assert len(manager.slots) == slots and len(manager.host) <= slots


def test_one_step_runs_several_adapters_and_the_base(make_llm, tiny_model, adapters, prompts):
    """The batched update really mixes: one step's LoRABatch runs three adapters' slots, and
    the scheduler's stats count requests per adapter."""
    from shoal.engine.lora import layers

    llm = make_llm(tiny_model, dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16)
    seen = []
    original = layers.active

    def spy(batch):
        if batch is not None:
            seen.append(len(batch.slots_used))
        return original(batch)

    layers.active = spy
    try:
        names = ["all", "attn", "mlp", None]
        stats = []
        core = llm.engine_core
        for i, n in enumerate(names):
            core.add_request(llm.input_processor.process(
                f"r{i}", prompts[1], greedy(), 0, lora(adapters, n)))
        while core.has_unfinished_requests():
            stats.append(core.step().scheduler_stats)
    finally:
        layers.active = original
    assert max(seen) == 3
    assert stats[0].running_lora_adapters == {"all": 1, "attn": 1, "mlp": 1}
    assert stats[0].waiting_lora_adapters == {}


def test_prefix_cache_is_never_shared_across_adapters(make_llm, tiny_model, adapters, prompts):
    llm = make_llm(tiny_model, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16)
    p = prompts[3]  # 40 tokens: two full blocks
    first = llm.generate([p], greedy(), lora_request=lora(adapters, "all"))[0]
    again = llm.generate([p], greedy(), lora_request=lora(adapters, "all"))[0]
    other = llm.generate([p], greedy(), lora_request=lora(adapters, "attn"))[0]
    base = llm.generate([p], greedy())[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 32
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0


def test_second_architecture_qwen2_equals_peft(make_llm, tiny_qwen2_model, tmp_path, prompts):
    path = lora_peft.make_adapter(tiny_qwen2_model, tmp_path / "q", 5)
    want = lora_peft.reference(tiny_qwen2_model, path, prompts, MAX_NEW)
    assert want != lora_peft.reference(tiny_qwen2_model, None, prompts, MAX_NEW)
    llm = make_llm(tiny_qwen2_model, dtype="float32", enable_lora=True, max_lora_rank=8)
    outs = llm.generate(prompts + prompts, greedy(),
                        lora_request=[LoRARequest("q", 1, path)] * len(prompts)
                        + [None] * len(prompts))
    assert tokens(outs)[:len(prompts)] == want


# -- refusals ----------------------------------------------------------------------------


def _edit_config(src: str, dst, **changes) -> str:
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return str(dst)


@pytest.fixture(scope="module")
def lora_llm(make_llm, tiny_model):
    return make_llm(tiny_model, dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8)


@pytest.mark.parametrize("change, says", [
    (dict(use_dora=True), "use_dora=True: DoRA"),
    (dict(bias="all"), "bias='all' is not supported"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(alpha_pattern={"q_proj": 4}), "alpha_pattern"),
    (dict(peft_type="IA3"), "peft_type 'IA3'"),
    (dict(r=32), "rank 32 is greater than --max-lora-rank 8"),
])
def test_config_options_that_cannot_be_applied_are_refused(change, says, lora_llm, adapters,
                                                           tmp_path, prompts):
    path = _edit_config(adapters["all"], tmp_path / "bad", **change)
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace("[", r"\[")):
        lora_llm.generate(prompts[:1], greedy(), lora_request=LoRARequest("bad", 9, path))


def test_rank_above_max_is_refused_from_the_tensors(lora_llm, adapters):
    with pytest.raises(ValueError, match="rank 16 is greater than --max-lora-rank 8"):
        lora_llm.generate([[5, 6]], greedy(), lora_request=lora(adapters, "mlp"))


def test_modules_it_cannot_apply_are_refused(lora_llm, tiny_model, tmp_path):
    path = lora_peft.make_adapter(tiny_model, tmp_path / "emb", 4, r=4,
                                  targets=["q_proj", "embed_tokens"])
    with pytest.raises(ValueError, match="embed_tokens"):
        lora_llm.generate([[5, 6]], greedy(), lora_request=LoRARequest("emb", 10, path))


def test_another_base_model_is_refused(lora_llm, tmp_path):
    """An adapter of a model with other shapes (the layer sizes named)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    other = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=96,
                                         num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=8192))
    get_peft_model(other, LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(
        str(tmp_path / "other"))
    with pytest.raises(ValueError, match=r"base model's layer is 256 -> 256.*another base model"):
        lora_llm.generate([[5, 6]], greedy(),
                          lora_request=LoRARequest("other", 11, str(tmp_path / "other")))


def test_missing_path_and_reused_id_are_refused(lora_llm, adapters, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        lora_llm.generate([[5, 6]], greedy(),
                          lora_request=LoRARequest("gone", 12, str(tmp_path / "nothing")))
    lora_llm.generate([[5, 6]], greedy(), lora_request=LoRARequest("a", 13, adapters["all"]))
    with pytest.raises(ValueError, match="cannot take the same id"):
        lora_llm.generate([[5, 6]], greedy(), lora_request=LoRARequest("b", 13, adapters["attn"]))


def test_lora_request_without_enable_lora_is_refused(make_llm, tiny_model, adapters):
    llm = make_llm(tiny_model, dtype="float32")
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        llm.generate([[5, 6]], greedy(), lora_request=lora(adapters, "all"))


def test_tensor_parallel_with_lora_is_refused(tiny_model):
    from shoal.engine.config import EngineConfig
    from shoal.engine.errors import ConfigError
    from shoal.engine.lora.config import LoRAConfig

    with pytest.raises(ConfigError, match="--enable-lora with --tensor-parallel-size 2"):
        EngineConfig(model=tiny_model, tensor_parallel_size=2, lora_config=LoRAConfig())


def test_lora_requests_info_is_vllms_gauge():
    """Its three labels (adapter names comma-joined), the time of the last step as its value,
    one series: the current one."""
    from shoal.engine.frontend.metrics import FrontendMetrics

    m = FrontendMetrics("tiny", max_loras=4)
    m.record_step(wire.SchedulerStats(running_lora_adapters={"a": 2, "b": 1},
                                      waiting_lora_adapters={"c": 1}), 0.0)
    m.record_step(wire.SchedulerStats(running_lora_adapters={"a": 1},
                                      waiting_lora_adapters={}), 1.0)
    lines = [x for x in m.render().decode().splitlines()
             if x.startswith("vllm:lora_requests_info{")]
    assert len(lines) == 1
    assert lines[0].startswith('vllm:lora_requests_info{max_lora="4",'
                               'running_lora_adapters="a",waiting_lora_adapters=""}')
    assert float(lines[0].rsplit(" ", 1)[1]) > 1.7e9
    assert "lora_requests_info" not in FrontendMetrics("tiny").render().decode()
