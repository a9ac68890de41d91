"""The grammar of a forced tool call (`tool_choice` "required" or a named function), written in
llguidance's Lark dialect, in the format the model's chat template writes calls in:

- Hermes style: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, the arguments
  held to the tool's JSON schema whole.
- Qwen3.5 style (its template writes `<function=`): `<tool_call>\\n<function=NAME>\\n`, then for
  each argument `<parameter=KEY>\\nVALUE\\n</parameter>\\n`, then `</function>\\n</tool_call>`; a
  string value is raw text, any other value JSON held to its property's schema. Arguments come in
  the schema's order, required ones always, optional ones if the model wants. Where that form
  cannot state the schema exactly (a string with a pattern or a length, keys beyond the listed
  properties), the call is asked for in Hermes style instead, which the parser reads as well.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from ballast.engine.text.grammar import lark_json, lark_literal
from ballast.server import protocol as p

Style = Literal["hermes", "xml"]
OPEN_CALL, CLOSE_CALL = "<tool_call>\n", "\n</tool_call>"  # as both templates write a call
_END_PARAMETER = "\n</parameter>\n"
_SAFE_KEY = re.compile(r"[^<>\n]+")
_STRING_LIMITS = ("pattern", "format", "minLength", "maxLength", "const")


def style_of(chat_template: str | None) -> Style:
    return "xml" if chat_template and "<function=" in chat_template else "hermes"


def tool_call_lark(tools: list[p.Tool], style: Style, several: bool) -> str:
    """One call of one of `tools`, or one or more calls when `several`."""
    rules: list[str] = []
    bodies: list[str] = []
    for i, tool in enumerate(tools):
        parameters = tool.function.parameters or {"type": "object", "properties": {}}
        bodies.append(f"tool{i}")
        if style == "xml" and _xml_expressible(parameters):
            rules += _xml_rules(f"tool{i}", tool.function.name, parameters)
        else:
            rules.append(f"tool{i}: {lark_json(_hermes_schema(tool.function.name, parameters))}")
    repeat = 'call ("\\n" call)*' if several else "call"
    call = f"call: {lark_literal(OPEN_CALL)} body {lark_literal(CLOSE_CALL)}"
    return "\n".join([f"start: {repeat}", call, f"body: {' | '.join(bodies)}", *rules])


def _hermes_schema(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """The call object, with the parameters' definitions (`$defs`, draft-07 `definitions`, which
    pydantic writes for every nested model) moved to its root, where their `#/$defs/...` references
    point; any other reference into the parameters is moved under `arguments` with them."""
    arguments = {k: v for k, v in parameters.items() if k not in _DEFINITIONS}
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": _rebased(arguments, "#/properties/arguments")},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        **{k: parameters[k] for k in _DEFINITIONS if k in parameters},
    }


_DEFINITIONS = ("$defs", "definitions")


def _rebased(schema: Any, root: str) -> Any:
    """`schema` with its references to its own root (`#`, `#/properties/...`) moved to `root`;
    references to definitions stay, as the definitions stay at the root."""
    if isinstance(schema, list):
        return [_rebased(s, root) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _rebased(v, root) for k, v in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#") and not ref.startswith(("#/$defs/", "#/definitions/")):
        out["$ref"] = root + ref[1:]
    return out


def _with_definitions(schema: dict[str, Any], parameters: dict[str, Any]) -> dict[str, Any]:
    """A property's schema standing alone, with the definitions its references need."""
    found = {k: parameters[k] for k in _DEFINITIONS if k in parameters}
    return {**schema, **found} if found and "$ref" in json.dumps(schema) else schema


def _xml_expressible(parameters: dict[str, Any]) -> bool:
    properties = parameters.get("properties")
    if not isinstance(properties, dict) or not properties:  # a free-form object: only JSON can say it
        return False
    if set(parameters.get("required", [])) - set(properties):
        return False
    for key, schema in properties.items():
        if not _SAFE_KEY.fullmatch(key) or not isinstance(schema, dict):
            return False
        if _is_string(schema) and any(limit in schema for limit in _STRING_LIMITS):
            return False
    return True


def _is_string(schema: dict[str, Any]) -> bool:
    enum = schema.get("enum")
    return schema.get("type") == "string" or (
        isinstance(enum, list) and bool(enum) and all(isinstance(v, str) for v in enum)
    )


def _xml_rules(rule: str, name: str, parameters: dict[str, Any]) -> list[str]:
    properties: dict[str, Any] = parameters.get("properties", {})
    required = set(parameters.get("required", []))
    parts: list[str] = []
    rules: list[str] = []
    for j, (key, schema) in enumerate(properties.items()):
        param, value = f"{rule}_p{j}", f"{rule}_v{j}"
        parts.append(param if key in required else f"{param}?")
        opening = lark_literal(f"<parameter={key}>" + "\n")
        rules.append(f"{param}: {opening} {value}")
        if isinstance(schema.get("enum"), list) and _is_string(schema):
            choices = " | ".join(lark_literal(v) for v in schema["enum"])
            rules.append(f"{value}: ({choices}) {lark_literal(_END_PARAMETER)}")
        elif _is_string(schema):
            # Raw text up to the first "\n</parameter>\n", which ends it.
            rules.append(f"{value}[suffix={lark_literal(_END_PARAMETER)}]: /(.|\\n)*/")
        else:
            rules.append(f"{value}: {value}_json {lark_literal(_END_PARAMETER)}")
            rules.append(f"{value}_json: {lark_json(_with_definitions(schema, parameters))}")
    head = lark_literal(f"<function={name}>" + "\n")
    return [f"{rule}: {head} {' '.join(parts)} {lark_literal('</function>')}", *rules]
