"""A StructuredOutputs spec as a llguidance grammar, and its validation (no tokenizer, no torch).

JSON is compiled compact (no free whitespace between tokens, as vLLM's `disable_any_whitespace`):
a model cannot pad its output with blanks until max_tokens runs out, and tool-call arguments
stream as exact fragments.
"""

from __future__ import annotations

import json

from shoal.engine.wire import StructuredOutputs

KINDS = ("json", "regex", "choice", "grammar")
_JSON_OPTIONS = {"whitespace_flexible": False}


def to_grammar(so: StructuredOutputs) -> str:
    """The llguidance grammar text for `so`; ValueError if the spec cannot even be read."""
    import llguidance

    if so.kind == "json":
        try:
            schema = json.loads(so.spec)
        except ValueError as exc:
            raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict | bool):
            raise ValueError("the JSON schema must be an object.")
        return llguidance.LLMatcher.grammar_from_json_schema(so.spec, defaults=_JSON_OPTIONS)
    if so.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(so.spec)
    if so.kind == "choice":
        choices = json.loads(so.spec)
        if not choices or not all(isinstance(c, str) for c in choices):
            raise ValueError("the choices must be a non-empty list of strings.")
        return llguidance.grammar_from("choice", choices)
    if so.kind == "grammar":
        return llguidance.grammar_from("grammar", so.spec)
    raise ValueError(f"unknown structured output kind {so.kind!r}; one of {list(KINDS)}.")


def check(so: StructuredOutputs) -> str:
    """The grammar text if `so` compiles; ValueError with llguidance's own message if not."""
    import llguidance

    grammar = to_grammar(so)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(error.strip())
    return grammar
