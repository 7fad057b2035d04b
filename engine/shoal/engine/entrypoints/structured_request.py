"""The request fields that ask for structured output, as one wire.StructuredOutputs, checked.

OpenAI's `response_format` ({"type": "json_object"} or {"type": "json_schema", "json_schema":
{"name", "schema", "strict"}}), vLLM's `structured_outputs` ({json, regex, choice, grammar,
json_object}) and its older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.
At most one may be given. The grammar is compiled here (llguidance, no tokenizer, no torch), so
an invalid schema or regex is a 400 naming the field, with the library's message, before the
request reaches the engine.
"""

from __future__ import annotations

import json

from shoal.engine.errors import InvalidRequestError
from shoal.engine.structured import spec
from shoal.engine.wire import StructuredOutputs

_JSON_OBJECT = json.dumps({"type": "object"})


def _schema_text(value, field: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, dict | bool):
        return json.dumps(value)
    raise InvalidRequestError(f"{field} must be a JSON schema (an object).")


def _asked(body) -> list[tuple[str, StructuredOutputs | None]]:
    """(field, spec) for every structured-output field set; spec None = plain text."""
    asked = []
    rf = body.response_format
    if rf is not None:
        if rf.type == "text":
            asked.append(("response_format", None))
        elif rf.type == "json_object":
            asked.append(("response_format", StructuredOutputs("json", _JSON_OBJECT)))
        elif rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise InvalidRequestError("response_format.json_schema.schema is required when "
                                          "response_format.type is 'json_schema'.")
            where = "response_format.json_schema.schema"
            asked.append((where, StructuredOutputs(
                "json", _schema_text(rf.json_schema.schema_, where))))
        else:
            raise InvalidRequestError(f"response_format.type {rf.type!r} is not supported; use "
                                      "'text', 'json_object' or 'json_schema'.")
    so = body.structured_outputs
    if so is not None:
        given = [(k, v) for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                     ("grammar", so.grammar)) if v is not None]
        if so.json_object:
            given.append(("json_object", _JSON_OBJECT))
        if len(given) != 1:
            raise InvalidRequestError("structured_outputs must set exactly one of json, regex, "
                                      "choice, grammar, json_object.")
        key, value = given[0]
        field = f"structured_outputs.{key}"
        asked.append((field, _spec(key, value, field)))
    for key in ("json", "regex", "choice", "grammar"):
        value = getattr(body, f"guided_{key}")
        if value is not None:
            asked.append((f"guided_{key}", _spec(key, value, f"guided_{key}")))
    return asked


def _spec(key: str, value, field: str) -> StructuredOutputs:
    if key in ("json", "json_object"):
        return StructuredOutputs("json", _schema_text(value, field))
    if key == "choice":
        return StructuredOutputs("choice", json.dumps(value))
    return StructuredOutputs(key, value)


def structured_outputs_of(body) -> StructuredOutputs | None:
    """The request's one constraint (None if none), compiled once to check it: a 400 that
    names the field if it does not compile."""
    asked = _asked(body)
    if len(asked) > 1:
        raise InvalidRequestError(f"only one structured output field may be given; got "
                                  f"{[f for f, _ in asked]}.")
    if not asked or asked[0][1] is None:
        return None
    field, so = asked[0]
    check(so, field)
    return so


def check(so: StructuredOutputs, field: str) -> None:
    try:
        spec.check(so)
    except ValueError as exc:
        raise InvalidRequestError(f"{field}: invalid {so.kind}: {exc}") from None
