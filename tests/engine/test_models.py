"""The project's own models: they load offline with transformers, and Qwen2 runs in shoal."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from shoal.engine import wire


def test_tiny_model_loads_offline_with_tokenizer_and_chat_template(tiny_model, monkeypatch):
    from transformers import AutoConfig, AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = AutoConfig.from_pretrained(tiny_model)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads) == (256, 4, 4, 2)
    assert cfg.architectures == ["LlamaForCausalLM"]
    tok = AutoTokenizer.from_pretrained(tiny_model)
    assert len(tok) == cfg.vocab_size == 8192
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    ids = tok("def main():\n    return 0").input_ids
    assert ids[0] == tok.bos_token_id and tok.decode(ids[1:]) == "def main():\n    return 0"
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert (Path(tiny_model) / "model.safetensors").is_file()


def test_model_maker_is_seeded(tiny_model, tmp_path):
    """Weights depend on the seed only: a second build gives identical tensors."""
    from safetensors.torch import load_file
    from shoal.engine.model_maker import build_config, build_weights

    again = build_weights(build_config("tiny", "llama")).state_dict()
    saved = load_file(str(Path(tiny_model) / "model.safetensors"))
    for name in ("model.layers.0.self_attn.q_proj.weight", "lm_head.weight"):
        assert torch.equal(again[name], saved[name])


def test_qwen2_matches_transformers(make_llm, tiny_qwen2_model):
    from transformers import AutoModelForCausalLM

    assert json.loads((Path(tiny_qwen2_model) / "config.json").read_text())["architectures"] == [
        "Qwen2ForCausalLM"]
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen2_model, dtype=torch.float32).eval()
    config = copy.deepcopy(hf.generation_config)
    config.eos_token_id, config.do_sample, config.max_new_tokens = None, False, 10
    prompts = [[7, 8, 9], list(range(100, 140)), list(range(2000, 2017))]
    llm = make_llm(tiny_qwen2_model, dtype="float32", max_model_len=256,
                   max_num_batched_tokens=32)
    outs = llm.generate(prompts, wire.SamplingParams(temperature=0.0, max_tokens=10,
                                                     ignore_eos=True))
    with torch.inference_mode():
        for p, out in zip(prompts, outs, strict=True):
            ref = hf.generate(torch.tensor([p]), generation_config=config)[0, len(p):].tolist()
            assert out.outputs[0].token_ids == ref
