"""The model matrix: every architecture shoal accepts is greedy-equal to transformers, and the
ones it cannot serve exactly are refused at start-up with an error naming the feature.

Each accepted architecture is a tiny random model (2-4 layers, 4 query / 2 KV heads of 16,
weights drawn with std 0.1 so attention is far from uniform) whose sliding windows (12 tokens)
are shorter than the prompts. Shoal runs it in float32 with chunked prefill (a 20-token budget)
and prefix caching on (the second batch repeats the first batch's prompts with new tails, so
cached blocks are reused), once on the CPU fast paths (the decode kernel, oneDNN-packed linear
layers, fused norms, MLP activations and RoPE) and once on torch's own ops (gather + SDPA, MKL
linear layers, eager elementwise ops); the
reference is transformers' greedy `generate` with its eager attention, one prompt at a time.
As in test_oracle.py, a divergence is accepted only at a near-tie of the reference's top two
logits. For the models with a window, soft-capping or sinks, the reference is first checked to
change when that feature is removed, so passing says the feature is implemented, not absent.
GPT-2 and OPT (learned positions, configs without num_key_value_heads) run too. The refusals
(config features, attention keywords, what the load-time probe rejects) are checked by message.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from shoal.engine import wire
from shoal.engine.worker.cpu import c_build
from shoal.engine.worker.cpu import decode_kernel as cpu_kernel
from shoal.engine.worker.cpu import fused as cpu_fused
from shoal.engine.worker.cpu import linear as cpu_linear

WINDOW = 12
MAX_NEW = 12
TIE_TOLERANCE = 1e-4
PROMPT_LENGTHS = [5, 13, 29, 47]
COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=256,
              bos_token_id=1, eos_token_id=None, pad_token_id=0,
              tie_word_embeddings=False)


@dataclass
class Arch:
    config_class: str
    kwargs: dict
    # Overrides that remove a feature: transformers' output must change without it.
    features: dict = field(default_factory=dict)

    def config(self, **overrides):
        import transformers

        return getattr(transformers, self.config_class)(**{**self.kwargs, **overrides})


def _configs() -> dict[str, Arch]:
    three = {**COMMON, "num_hidden_layers": 3}
    return {
        "llama": Arch("LlamaConfig", COMMON),
        "mistral": Arch("MistralConfig", dict(sliding_window=WINDOW, **COMMON),
                        {"sliding_window": None}),
        "qwen2": Arch("Qwen2Config", dict(use_sliding_window=True, sliding_window=WINDOW,
                                          max_window_layers=1, **three),
                      {"use_sliding_window": False}),
        "qwen3": Arch("Qwen3Config", dict(attention_bias=True, **COMMON)),
        "gemma2": Arch("Gemma2Config", dict(sliding_window=WINDOW, query_pre_attn_scalar=16,
                                            attn_logit_softcapping=2.0,
                                            final_logit_softcapping=3.0, **COMMON),
                       {"layer_types": ["full_attention"] * 2, "attn_logit_softcapping": None}),
        "gemma3": Arch("Gemma3TextConfig", dict(
            sliding_window=WINDOW, query_pre_attn_scalar=16, **three,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
            {"layer_types": ["full_attention"] * 3}),
        "phi3": Arch("Phi3Config", dict(sliding_window=WINDOW, **COMMON),
                     {"sliding_window": None}),
        "olmo2": Arch("Olmo2Config", dict(attention_bias=True, **COMMON)),
        "gpt-oss": Arch("GptOssConfig", dict(sliding_window=WINDOW, num_local_experts=4,
                                             num_experts_per_tok=2, **COMMON),
                        {"layer_types": ["full_attention"] * 2, "sinks": None}),
        "granite": Arch("GraniteConfig", dict(embedding_multiplier=2.0, logits_scaling=1.5,
                                              residual_multiplier=0.7,
                                              attention_multiplier=0.2, **COMMON)),
        "gpt2": Arch("GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, vocab_size=512,
                                        n_positions=256, bos_token_id=1, eos_token_id=None)),
        "opt": Arch("OPTConfig", dict(hidden_size=64, ffn_dim=96, num_hidden_layers=2,
                                      num_attention_heads=4, vocab_size=512,
                                      max_position_embeddings=256, word_embed_proj_dim=64,
                                      bos_token_id=1, eos_token_id=None, pad_token_id=0)),
    }


ARCHS = list(_configs())


def _randomise(model) -> None:
    """Weights with std 0.1 (norm weights near 1, sinks near 0 with std 1): a wrong window, cap,
    sink or head changes the greedy tokens, where the tiny default init would hide it."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln" in name.split(".")[-2]:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))


def _build(arch: Arch, **changes):
    import transformers

    sinks = changes.pop("sinks", "kept")
    cfg = arch.config(**changes)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32,
                                                          attn_implementation="eager")
    _randomise(model)
    if sinks is None:  # a sink of -1e4 takes no share of the softmax: sinks removed
        for module in model.modules():
            if hasattr(module, "sinks"):
                module.sinks.data.fill_(-1e4)
    return model.eval()


def _greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id, config.do_sample, config.max_new_tokens = None, False, MAX_NEW
    config.pad_token_id = 0
    out = []
    with torch.inference_mode():
        for p in prompts:
            gen = model.generate(torch.tensor([p]), generation_config=config)
            out.append(gen[0, len(p):].tolist())
    return out


def _prompts() -> tuple[list[list[int]], list[list[int]]]:
    """Two batches; the second repeats each first-batch prompt with a new tail (prefix hits)."""
    gen = torch.Generator().manual_seed(7)
    first = [torch.randint(5, 512, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    second = [p + torch.randint(5, 512, (9,), generator=gen).tolist() for p in first]
    return first, second


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> dict:
    """{arch: (path, transformers model, [reference outputs per prompt of both batches])}."""
    root = tmp_path_factory.mktemp("matrix")
    first, second = _prompts()
    out = {}
    for name, arch in _configs().items():
        model = _build(arch)
        path = root / name
        model.save_pretrained(path)
        out[name] = (str(path), model, _greedy(model, first + second), arch)
    return out


def _top2_gap(model, tokens: list[int]) -> float:
    with torch.inference_mode():
        logits = model(torch.tensor([tokens])).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


@pytest.mark.parametrize("path_kind", ["kernel", "torch"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_transformers_with_chunked_prefill_and_prefix_caching(
        arch, path_kind, matrix, make_llm, tiny_model, monkeypatch):
    if path_kind == "kernel" and c_build.compiler() is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv(cpu_kernel.DISABLE_ENV, "1" if path_kind == "kernel" else "0")
    monkeypatch.setenv(cpu_linear.DISABLE_ENV, "1" if path_kind == "kernel" else "0")
    monkeypatch.setenv(cpu_fused.DISABLE_ENV, "1" if path_kind == "kernel" else "0")
    path, model, reference, _ = matrix[arch]
    llm = make_llm(path, tokenizer=tiny_model, dtype="float32", max_model_len=256,
                   max_num_batched_tokens=20, enable_prefix_caching=True)
    runner = llm.engine_core.model_executor.worker.model_runner
    assert (runner.cpu.decode_kernel is not None) == (path_kind == "kernel")
    modules = list(runner.model.modules())
    if path_kind == "kernel":  # every nn.Linear is packed but a head tied to the embeddings
        embeddings = runner.model.get_input_embeddings().weight
        assert all(m.weight is embeddings for m in modules if type(m) is torch.nn.Linear)
        # Every RMSNorm and SiLU-gated MLP is fused (the probe agreed), and so is every
        # rotate-half RoPE; gpt-oss's rotary form is not, and stays transformers' own.
        assert not [m for m in modules if type(m).__name__.endswith("RMSNorm")
                    and not isinstance(m, cpu_fused.FusedRMSNorm)]
        assert not [m for m in modules if cpu_fused._is_silu_mlp(m)]
        rope = cpu_fused.describe_rope(runner.cpu.fused.rope)
        if arch in ("gpt2", "opt"):
            assert "does not call" in rope
        else:
            assert rope.startswith("torch's own" if arch == "gpt-oss" else "fused"), rope
    else:
        assert runner.cpu.packed_linears == 0 and runner.cpu.fused.ops is None
        assert not [m for m in modules
                    if isinstance(m, (cpu_fused.FusedRMSNorm, cpu_fused.FusedSiluMLP))]
    params = wire.SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    first, second = _prompts()
    outputs = llm.generate(first, params) + llm.generate(second, params)
    assert llm.stats["prefix_cache_hits"] > 0, "the second batch should reuse cached blocks"
    assert llm.stats["steps"] > 2 * MAX_NEW + 4, "the 20-token budget should chunk the prompts"
    for i, (p, ref, out) in enumerate(zip(first + second, reference, outputs, strict=True)):
        got = out.outputs[0].token_ids
        if got == ref:
            continue
        pos = next(j for j, (a, b) in enumerate(zip(got, ref, strict=True)) if a != b)
        gap = _top2_gap(model, p + ref[:pos])
        assert gap < TIE_TOLERANCE, (
            f"{arch} prompt {i} (len {len(p)}) diverges at token {pos}: shoal {got[pos]} vs "
            f"transformers {ref[pos]}; top-2 gap {gap:.3g} is not a near-tie")


@pytest.mark.parametrize("arch", [a for a in ARCHS if _configs()[a].features])
def test_the_features_change_the_reference(arch, matrix):
    """Without its window, soft-cap or sinks, the model generates other tokens: the matrix
    would catch an engine that dropped them."""
    _, _, reference, spec = matrix[arch]
    first, second = _prompts()
    without = _greedy(_build(spec, **spec.features), first + second)
    assert without != reference


# -- refusals: at start-up, naming the feature and the model --------------------------------

def _save_config(cfg, path: Path) -> str:
    cfg.save_pretrained(path)
    return str(path)


def _refusals():
    import transformers as t

    return {
        "gemma3-bidirectional": (
            lambda: t.Gemma3TextConfig(use_bidirectional_attention=True, **COMMON),
            r"Gemma3ForCausalLM\) uses bidirectional attention \(use_bidirectional_attention\)"),
        "llama4-chunked": (
            lambda: t.Llama4TextConfig(hidden_size=64, intermediate_size=96,
                                       intermediate_size_mlp=96, num_hidden_layers=4,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       vocab_size=512, attention_chunk_size=8,
                                       num_local_experts=2),
            r"Llama4ForCausalLM\) uses layer types \['chunked_attention'\]"),
    }


@pytest.mark.parametrize("name", list(_refusals()))
def test_unimplemented_features_are_refused_at_start_up(name, tmp_path):
    from shoal.engine.config import EngineConfig
    from shoal.engine.worker.model_runner import ModelRunner

    factory, message = _refusals()[name]
    cfg = factory()
    cfg.architectures = [type(cfg).__name__.replace("TextConfig", "ForCausalLM")
                         .replace("Config", "ForCausalLM")]
    model = _save_config(cfg, tmp_path / name)
    runner = ModelRunner(EngineConfig(model=model, max_model_len=64), torch.device("cpu"))
    with pytest.raises(ValueError, match=message) as err:
        runner.load_model()
    assert model in str(err.value) and "refusing to serve it" in str(err.value)
    assert runner.model is None  # refused from the config, before any weight was loaded


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory) -> str:
    import transformers

    cfg = transformers.LlamaConfig(**COMMON)
    cfg.architectures = ["LlamaForCausalLM"]
    path = tmp_path_factory.mktemp("probe-llama")
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("extra, message", [
    ({"position_bias": torch.zeros(1)}, r"LlamaAttention asks attention for \['position_bias'\]"),
    ({"is_causal": False}, r"LlamaAttention asks for bidirectional attention"),
])
def test_an_attention_keyword_the_engine_does_not_implement_is_refused_at_load(
        extra, message, tiny_llama_dir, monkeypatch):
    """A layer that hands attention a keyword shoal does not implement (an ALiBi-style bias,
    a non-causal flag; injected into Llama's layer here) is refused by the load-time probe,
    naming the keyword and the model."""
    import transformers
    from shoal.engine.config import EngineConfig
    from shoal.engine.worker.model_runner import ModelRunner

    attention = transformers.models.llama.modeling_llama.LlamaAttention
    real_forward = attention.forward
    monkeypatch.setattr(attention, "forward",
                        lambda self, *a, **kw: real_forward(self, *a, **extra, **kw))
    runner = ModelRunner(EngineConfig(model=tiny_llama_dir, max_model_len=64),
                         torch.device("cpu"))
    with pytest.raises(ValueError, match=r"probe-llama.*\(LlamaForCausalLM\): " + message):
        runner.load_model()


def _call(layer, heads=(4, 2, 16), q_len=3, k_len=3, mask=False, causal=True, window=None):
    from shoal.engine.worker.model_check import LayerCall
    from shoal.engine.worker.paged_attention import Variant

    return LayerCall(layer, "Attn", *heads, q_len, k_len, Variant(window), mask, causal)


@pytest.mark.parametrize("calls, message", [
    ([], "does not route attention through AttentionInterface"),
    ([_call(0)], r"attention layers called \[0\] of 2 \(missing \[1\]"),
    ([_call(0), _call(1, heads=(4, 4, 16))], r"layers differ in \(query heads, KV heads"),
    ([_call(0), _call(1, k_len=7)], "cross-attention or shared KV"),
    ([_call(0), _call(1, mask=True)], "mask or bias the model builds itself"),
    ([_call(0), _call(1, causal=False)], "is bidirectional"),
])
def test_the_probe_refuses_what_the_cache_cannot_hold(calls, message):
    import types

    from shoal.engine.worker.model_check import _layout

    cfg = types.SimpleNamespace(num_hidden_layers=2)
    with pytest.raises(ValueError, match=message):
        _layout(calls, cfg, "m")


def test_the_probe_checks_sliding_layers_against_layer_types():
    import types

    from shoal.engine.worker.model_check import _layout

    cfg = types.SimpleNamespace(num_hidden_layers=2, sliding_window=8,
                                layer_types=["sliding_attention", "full_attention"])
    layout = _layout([_call(1), _call(0, window=8)], cfg, "m")
    assert (layout.windows, layout.num_kv_heads, layout.head_dim) == ([8, None], 2, 16)
    with pytest.raises(ValueError, match="layer 0 is a sliding_attention layer but its "
                                         "attention is called with sliding_window=None"):
        _layout([_call(0), _call(1)], cfg, "m")


def test_gpt2_is_accepted_by_its_head_and_gets_its_context_length(matrix):
    """GPT-2's class is GPT2LMHeadModel and its config says n_positions: the engine config takes
    both (what GPT-2 uses is then checked at load like any other model)."""
    from shoal.engine.config import EngineConfig

    config = EngineConfig(model=matrix["gpt2"][0])
    assert config.architectures == ("GPT2LMHeadModel",) and config.max_model_len == 256
