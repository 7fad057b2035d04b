"""`shoal make-model DIR`: write the project's own small model, so nothing is downloaded.

The directory is an ordinary Hugging Face model directory (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json, generation_config.json) that
`AutoModelForCausalLM.from_pretrained(DIR)` and `AutoTokenizer.from_pretrained(DIR)` load offline.

- Weights are random but seeded, so two machines make the same model.
- The tokenizer is a byte-level BPE trained with `tokenizers` on Python's own standard-library
  sources (present on every machine), read in sorted order and capped in size so training takes
  seconds.
- Three sizes: `tiny` for tests, `small` for compute-bound benchmarks on the CPU, `large` for a
  GPU: Llama-3-8B's layer shape (hidden 4096, MLP 14336, 32 query / 8 KV heads of 128) with 8 of
  its 32 layers and this vocabulary, about 1.8 B parameters (7.2 GB as written, in float32), so
  that a step's GEMMs weigh what a real 8B model's do per layer. `--arch qwen2` writes the same
  shapes as a Qwen2 model (q/k/v biases), to show a second architecture works.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
from pathlib import Path

SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2),
    "small": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                  num_attention_heads=12, num_key_value_heads=4),
    "large": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=8,
                  num_attention_heads=32, num_key_value_heads=8),
}
ARCHS = ("llama", "qwen2")
VOCAB_SIZE = 8192
MAX_POSITIONS = 2048
SEED = 1234
# Bytes of stdlib source fed to the BPE trainer: enough for a sensible 8k vocabulary, small
# enough that training takes a few seconds on two cores.
TRAIN_TEXT_BYTES = 6 * 1024 * 1024

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_START, IM_END]  # ids 0..4, in this order
# ChatML; a turn ends with <|im_end|>, which generation_config also lists as an end token.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _training_text() -> list[str]:
    """Standard-library .py files in sorted order, up to TRAIN_TEXT_BYTES in total."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    files += sorted(p for p in root.glob("*/*.py") if "test" not in p.parts[-2])
    texts, total = [], 0
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(text)
        total += len(text)
        if total >= TRAIN_TEXT_BYTES:
            break
    if not texts:
        raise RuntimeError(f"no Python sources found under {root} to train the tokenizer on")
    return texts


def train_tokenizer(out_dir: Path) -> None:
    """Train the byte-level BPE and write tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_text(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    tok.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "additional_special_tokens": [IM_START, IM_END],
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}, indent=2)
    )


def build_config(size: str, arch: str):
    """The transformers config object for one size and architecture."""
    from transformers import LlamaConfig, Qwen2Config

    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(SIZES)}")
    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {list(ARCHS)}")
    ids = {name: SPECIAL_TOKENS.index(tok) for name, tok in
           (("bos_token_id", BOS), ("eos_token_id", EOS), ("pad_token_id", PAD))}
    common = dict(
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        tie_word_embeddings=False,
        torch_dtype="float32",
        **SIZES[size],
        **ids,
    )
    if arch == "qwen2":
        return Qwen2Config(rope_theta=1_000_000.0, use_sliding_window=False, **common)
    return LlamaConfig(rope_theta=10_000.0, **common)


def build_weights(config, seed: int = SEED):
    """Seeded random weights; the output head is scaled up so logits are not near-uniform
    (a random model with tiny logits would make greedy decoding fragile)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.02, generator=gen)
            elif name == "lm_head.weight":
                param.normal_(0.0, 0.25, generator=gen)
            elif "embed_tokens" in name:
                param.normal_(0.0, 1.0, generator=gen)
            else:
                param.normal_(0.0, 0.06, generator=gen)
    return model


def make_model(path: str | os.PathLike, size: str = "tiny", arch: str = "llama") -> Path:
    """Write a complete model directory at `path` and return it."""
    from transformers import GenerationConfig

    out = Path(path)
    config = build_config(size, arch)
    out.mkdir(parents=True, exist_ok=True)
    train_tokenizer(out)
    model = build_weights(config)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=[config.eos_token_id, SPECIAL_TOKENS.index(IM_END)],
        pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(out, safe_serialization=True)
    share_readable(out)
    return out


def share_readable(out: Path) -> None:
    """Make every file readable and every directory searchable by all users.

    Some writers create private files (safetensors' model.safetensors comes out 0600), but a
    model directory is read by other users: the engine image runs as uid 10001 and mounts the
    directory read-only, and a 0600 file fails there with an error that reads like a missing
    model."""
    for path in [out, *out.rglob("*")]:
        mode = path.stat().st_mode
        wanted = mode | (0o755 if path.is_dir() else 0o444)
        if wanted != mode:
            path.chmod(wanted)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shoal make-model", description=__doc__.split("\n")[0])
    parser.add_argument("dir", help="directory to write the model into (created if missing)")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny",
                        help="tiny: hidden 256, 4 layers (tests); small: hidden 768, 12 layers "
                             "(benchmarks); large: hidden 4096, 8 layers of Llama-3-8B's shape "
                             "(GPU benchmarks, 7.2 GB). Default: tiny")
    parser.add_argument("--arch", choices=ARCHS, default="llama",
                        help="llama (default) or qwen2 (same shapes, q/k/v biases)")
    args = parser.parse_args(argv)
    out = make_model(args.dir, args.size, args.arch)
    print(f"wrote {args.size} {args.arch} model to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
