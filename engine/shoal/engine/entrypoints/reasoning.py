"""`--reasoning-parser` (qwen3, deepseek_r1): the model's `<think>...</think>` leaves the answer's
`content` and arrives as `reasoning`, the field vLLM 0.32 writes (its ChatMessage and
DeltaMessage; a replayed assistant message may send it back as `reasoning` or the older
`reasoning_content`).

Both follow vLLM's: the text before `</think>` is reasoning even without a `<think>` (the chat
template may have written it into the prompt); `content` is null when nothing follows
`</think>`. deepseek_r1 streams as vLLM's DeepSeekR1ReasoningParser (ReasoningStream): a delta
that is only the start or end token is not sent, one that holds `</think>` is split in two
fields. qwen3 streams as vLLM 0.32's Qwen3Parser (Qwen3Stream, see there), and reads the
request's `chat_template_kwargs.enable_thinking`: false means no reasoning, all content.
Streaming decides by token ids, as vLLM does, so `<think>` and `</think>` must be single tokens
of the model's vocabulary; a server whose tokenizer lacks them fails at start-up, as vLLM's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.engine.errors import ConfigError

REASONING_PARSERS = ("deepseek_r1", "qwen3")
START, END = "<think>", "</think>"
TOOL_START = "<tool_call>"


def _token_id(tokenizer, token: str) -> int | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.token_to_id(token)
    return tokenizer.get_vocab().get(token)  # transformers' tokenizers


@dataclass(frozen=True)
class ReasoningParser:
    """One server's parser: its name and the ids of the think tokens in its vocabulary."""

    name: str
    start_id: int
    end_id: int

    @classmethod
    def load(cls, name: str, tokenizer) -> ReasoningParser:
        if name not in REASONING_PARSERS:
            raise ConfigError(f"unknown reasoning parser {name!r}; known: {REASONING_PARSERS}")
        ids = _token_id(tokenizer, START), _token_id(tokenizer, END)
        if None in ids:
            raise ConfigError(f"--reasoning-parser {name}: could not locate {START} / {END} "
                              "tokens in the model's tokenizer (as vLLM refuses it)")
        return cls(name, *ids)

    def thinks(self, template_kwargs: dict | None) -> bool:
        """False when qwen3's chat template was told enable_thinking=false."""
        return self.name != "qwen3" or (template_kwargs or {}).get("enable_thinking", True)

    def split(self, text: str, thinking: bool = True) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output: vLLM's extract_reasoning."""
        if not thinking:
            return None, text
        if self.name == "qwen3":
            return _qwen3_split(text)
        before, start, after = text.partition(START)
        text = after if start else before
        if END not in text:
            return text, None
        reasoning, _, content = text.partition(END)
        return reasoning, content or None

    def stream(self, thinking: bool = True) -> ReasoningStream | Qwen3Stream:
        if self.name == "qwen3":
            return Qwen3Stream(self, "reasoning" if thinking else "content")
        return ReasoningStream(self, thinking)


def _first_end(text: str) -> tuple[int, int]:
    """(where the reasoning ends, where the content starts): at `</think>` (dropped) or at a
    `<tool_call>` (kept: the call is content), whichever comes first; (-1, -1) if neither."""
    ends = [(i, i + len(END)) for i in [text.find(END)] if i >= 0]
    ends += [(i, i) for i in [text.find(TOOL_START)] if i >= 0]
    return min(ends) if ends else (-1, -1)


def _qwen3_split(text: str) -> tuple[str | None, str | None]:
    """vLLM 0.32's Qwen3Parser on a whole output: as deepseek_r1, but a `<tool_call>` also ends
    the reasoning, and a later `</think>` is dropped from the content."""
    end, start = _first_end(text)
    head = text if end < 0 else text[:end]
    if START in head:
        text = text.replace(START, "", 1)
        end, start = _first_end(text)
    if end < 0:
        return text, None
    return text[:end], text[start:].replace(END, "") or None


@dataclass
class ReasoningStream:
    """One choice's deltas, split as vLLM's extract_reasoning_streaming (deepseek_r1's, which
    treats text before any `<think>` as reasoning)."""

    parser: ReasoningParser
    thinking: bool = True
    seen_start: bool = False
    seen_end: bool = False
    _ids: list[int] = field(default_factory=list)

    def feed(self, text: str, token_ids: list[int]) -> dict | None:
        """The delta's fields (`reasoning` and/or `content`; a key set to None is sent as null,
        as vLLM's exclude_unset does), or None when the delta is nothing to send."""
        p = self.parser
        before_start, before_end = self.seen_start, self.seen_end
        self.seen_start = before_start or p.start_id in token_ids
        self.seen_end = before_end or p.end_id in token_ids
        if not self.thinking:
            return {"content": text}
        if len(token_ids) == 1 and token_ids[0] in (p.start_id, p.end_id):
            return None
        in_start, in_end = p.start_id in token_ids, p.end_id in token_ids
        if in_start and not before_start and in_end:
            text = text[text.find(START) + len(START):]
        elif in_start and not before_start:
            return {"reasoning": text}  # vLLM's: the start token's text stays in
        if in_end:
            end = text.find(END)
            content = text[end + len(END):]
            return {"reasoning": text[:end], "content": content or None}
        if before_end:
            return {"content": text}
        return {"reasoning": text}


def _overlap(text: str, *tags: str) -> int:
    """The longest end of `text` that could begin one of `tags`."""
    return max((k for tag in tags for k in range(min(len(tag) - 1, len(text)), 0, -1)
                if text.endswith(tag[:k])), default=0)


@dataclass
class Qwen3Stream:
    """One choice's deltas as vLLM 0.32's Qwen3Parser streams them (its parser engine): the think
    tags are markup, never text; `</think>` ends the reasoning only as its token (text spelling
    it out in pieces is text); a `<tool_call>` ends it too; an end of reasoning text that could
    begin a tag waits for the next delta; whitespace that starts the content waits for the first
    other character; a later `</think>` token is dropped. Fields that would be empty are left
    out; nothing to send is None."""

    parser: ReasoningParser
    state: str = "reasoning"
    held: str = ""
    started: bool = False  # content other than whitespace has been sent

    def feed(self, text: str, token_ids: list[int]) -> dict | None:
        p, out = self.parser, {}
        text, self.held = self.held + text, ""
        if self.state == "reasoning":
            if p.start_id in token_ids:
                text = text.replace(START, "", 1)
            end, start = _first_end(text)
            if end >= 0 and text.startswith(END, end) and p.end_id not in token_ids:
                end = -1  # "</think>" as plain text, not the token
            if end < 0:
                keep = len(text) - _overlap(text, END, TOOL_START)
                text, self.held = text[:keep], text[keep:]
                if text:
                    out["reasoning"] = text
                return out or None
            if text[:end]:
                out["reasoning"] = text[:end]
            text, self.state = text[start:], "content"
        if p.end_id in token_ids:
            text = text.replace(END, "")
        if not self.started and not text.strip():
            self.held = text
        elif text:
            out["content"], self.started = text, True
        return out or None
