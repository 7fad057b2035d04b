"""Tool calling for /v1/chat/completions: what `tools` + `tool_choice` ask of the engine.

vLLM's behaviour, with the same grammar machinery as response_format:
- "none": generation is free and no call is read out of it; the tools still reach the chat
  template (vLLM's default: its `--exclude-tools-when-tool-choice-none` is off);
- "required": the output is constrained to a JSON array (at least one item; at most one when
  parallel_tool_calls is false) of {"name": <one of the tools>, "parameters": <its schema>};
- {"type": "function", "function": {"name": N}}: the output is constrained to N's parameters
  schema and becomes that call's arguments;
- "auto" (the default when tools are given): generation is free and the tool parser
  (`--tool-call-parser hermes|pythonic|qwen3_coder`: tool_parsers.py) finds the calls in it;
  refused with a 400 unless the server runs with `--enable-auto-tool-choice` and a parser.

Forced calls ("required", named) follow the parameters schema with every object that declares
`properties` closed to them (`additionalProperties: false` where the schema says nothing):
vLLM's default grammar backend, xgrammar, compiles JSON schemas in strict mode, which allows no
property a schema does not name. Without it a weak model adds keys until max_tokens.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from shoal.engine.errors import InvalidRequestError
from shoal.engine.wire import StructuredOutputs

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "pythonic", "qwen3_coder")


@dataclass(frozen=True)
class ToolSettings:
    """The server's flags (vLLM's names)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # --reasoning-parser (reasoning.py): read before the tool calls, which follow the thinking.
    reasoning_parser: str | None = None


@dataclass
class ToolPlan:
    """How one request uses its tools."""

    mode: str  # "none", "auto", "required", "named"
    tools: list[dict]  # the OpenAI tool objects, as the chat template gets them
    structured_outputs: StructuredOutputs | None = None
    function_name: str | None = None  # "named" only
    parallel: bool = True
    parser: str = "hermes"  # "auto" only: --tool-call-parser (TOOL_CALL_PARSERS)

    @property
    def template_tools(self) -> list[dict] | None:
        return self.tools or None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _parameters(tool) -> dict:
    return closed_objects(tool.function.parameters or {"type": "object", "properties": {}})


# Keywords whose value is one schema, a list of schemas, or a name -> schema map.
_ONE = ("items", "additionalItems", "not", "if", "then", "else", "contains")
_MANY = ("anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "$defs", "definitions", "patternProperties")


def closed_objects(schema):
    """A copy of `schema` where each object that declares `properties` and says nothing about
    more (`additionalProperties`, `unevaluatedProperties`) allows no other property: xgrammar's
    strict mode, vLLM's default. Objects under `allOf` stay open: each part names only some of
    the properties, so closing one would refuse the others'."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if key in out:
            out[key] = closed_objects(out[key])
    for key in _MANY:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(x) for x in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(x) for name, x in out[key].items()}
    if (isinstance(out.get("properties"), dict) and out["properties"] and "allOf" not in out
            and "additionalProperties" not in out and "unevaluatedProperties" not in out):
        out["additionalProperties"] = False
    return out


def required_schema(tools, parallel: bool) -> dict:
    """A JSON array of {"name", "parameters"} items, one schema branch per tool (vLLM's)."""
    items = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t.function.name]},
                             "parameters": _parameters(t)},
              "required": ["name", "parameters"], "additionalProperties": False}
             for t in tools]
    schema: dict = {"type": "array", "minItems": 1,
                    "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def plan_tools(body, settings: ToolSettings) -> ToolPlan | None:
    """The request's ToolPlan (None without tools); a 400 naming the field for what the server
    does not do."""
    tools = body.tools or []
    choice = body.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise InvalidRequestError("tool_choice is set but no tools were given: add `tools`.")
        return None
    for i, t in enumerate(tools):
        if t.type != "function":
            raise InvalidRequestError(f"tools[{i}].type {t.type!r} is not supported; only "
                                      "'function' tools are.")
    names = [t.function.name for t in tools]
    parallel = body.parallel_tool_calls is not False
    as_dicts = [t.model_dump(exclude_none=True) for t in tools]
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        fn = ((choice.get("function") or {}).get("name")
              if choice.get("type") == "function" else None)
        if not isinstance(fn, str):
            raise InvalidRequestError('tool_choice must be "none", "auto", "required" or '
                                      '{"type": "function", "function": {"name": ...}}.')
        if fn not in names:
            raise InvalidRequestError(f"tool_choice names the function {fn!r}, which is not in "
                                      f"tools: {names}.")
        tool = tools[names.index(fn)]
        so = StructuredOutputs("json", json.dumps(_parameters(tool)))
        return ToolPlan("named", as_dicts, so, fn, parallel)
    if choice == "none":
        return ToolPlan("none", as_dicts)
    if choice == "required":
        so = StructuredOutputs("json", json.dumps(required_schema(tools, parallel)))
        return ToolPlan("required", as_dicts, so, None, parallel)
    if choice == "auto":
        if not settings.enable_auto_tool_choice or not settings.tool_call_parser:
            raise InvalidRequestError('"auto" tool choice requires --enable-auto-tool-choice and '
                                      '--tool-call-parser to be set (tool_choice).')
        return ToolPlan("auto", as_dicts, None, None, parallel, settings.tool_call_parser)
    raise InvalidRequestError(f"tool_choice {choice!r} is not supported; use \"none\", \"auto\", "
                              '"required" or {"type": "function", "function": {"name": ...}}.')
