"""The model's tokenizer, straight from `tokenizer.json` with the `tokenizers` library.

Here, beside the wire, because both processes use it: the frontend tokenizes prompts and
detokenizes outputs; the engine core builds structured output's grammar tokenizer from it
(structured/manager.py). Neither imports the other's half for it.

Why not transformers' AutoTokenizer: importing it pulls in torch, which costs the frontend
process ~350 MiB and, on a small machine, tens of seconds of start-up that compete for the CPU
with the engine loading its weights. The frontend only needs encode, decode, the special tokens
and the chat template, so it reads them itself. A model directory without a tokenizer.json
(a slow, Python-only tokenizer) falls back to AutoTokenizer.

The behaviour matches transformers' fast tokenizers: `add_special_tokens` runs tokenizer.json's
post-processor (e.g. prepending BOS); the chat template renders in a sandboxed Jinja environment
with trim_blocks/lstrip_blocks and is encoded without special tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # {"content": "<|eos|>", ...} in older configs
        return value.get("content")
    return value


def _clean_up_spaces(text: str) -> str:
    """transformers' clean_up_tokenization (only when the config asks for it)."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                 (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


class FastTokenizer:
    def __init__(self, model_dir: str) -> None:
        from tokenizers import Tokenizer

        root = Path(model_dir)
        self.backend_tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
        config: dict = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):
            path = root / name
            if path.is_file():
                config.update(json.loads(path.read_text()))
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token_id = self._id(self.bos_token)
        self.eos_token_id = self._id(self.eos_token)
        self.chat_template = config.get("chat_template")
        if self.chat_template is None and (root / "chat_template.jinja").is_file():
            self.chat_template = (root / "chat_template.jinja").read_text()
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces"))
        self._template = None

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def __call__(self, text: str, add_special_tokens: bool = True) -> SimpleNamespace:
        enc = self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return SimpleNamespace(input_ids=enc.ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_spaces(text) if self.clean_up_tokenization_spaces else text

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = True, tools: list[dict] | None = None,
                            **template_kwargs):
        """`tools` (OpenAI tool objects) reach the template as `tools`, as transformers passes
        them; a template that does not use them renders as without. `template_kwargs` are
        further template variables (a request's chat_template_kwargs), below the named ones."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; use /v1/completions")
        if self._template is None:
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                raise TemplateError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(self.chat_template)
        text = self._template.render({
            **template_kwargs, "messages": messages, "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token or "", "eos_token": self.eos_token or "", "tools": tools})
        if not tokenize:
            return text
        return self(text, add_special_tokens=False).input_ids


def load_tokenizer(model_dir: str):
    """FastTokenizer when the directory has a tokenizer.json, else transformers' AutoTokenizer."""
    if (Path(model_dir) / "tokenizer.json").is_file():
        return FastTokenizer(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
