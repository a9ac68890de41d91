"""Tool calls in a model's text: the formats the served families' chat templates write, parsed
into OpenAI `tool_calls`, whole (`parse`) or as a stream (`ToolCallStream`).

Both formats wrap each call in `<tool_call>` ... `</tool_call>`:
- Hermes style (Qwen2.5, Qwen3, Qwen3-Next, and what ballast asks of models whose template has no
  tool format): a JSON object `{"name": ..., "arguments": {...}}`.
- Qwen3.5 (and Qwen3-Coder): `<function=NAME>` with one `<parameter=KEY>` block per argument,
  whose value is the raw text for a string and JSON for anything else.
The body decides which one it is, so a model may answer in either. A block that parses as
neither stays in the content, as the model wrote it.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


@dataclass(frozen=True)
class Call:
    id: str
    name: str
    arguments: str  # JSON text of an object


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse(text: str, schemas: dict[str, dict[str, Any]]) -> tuple[str | None, list[Call]]:
    """(content, calls) of a whole answer. `schemas` maps each tool's name to its parameters'
    JSON schema, which says which XML-style values are strings."""
    calls: list[Call] = []
    content: list[str] = []
    last = 0
    for match in _BLOCK.finditer(text):
        call = parse_block(match.group(1), schemas)
        if call is None:
            continue
        content.append(text[last : match.start()])
        last = match.end()
        calls.append(call)
    content.append(text[last:])
    joined = "".join(content).strip() if calls else text
    return (joined or None), calls


def parse_block(body: str, schemas: dict[str, dict[str, Any]]) -> Call | None:
    """One call from the text between <tool_call> and </tool_call>; None if it is not one."""
    body = body.strip()
    if body.startswith("{"):
        return _hermes(body)
    function = _FUNCTION.fullmatch(body)
    if function is None:
        return None
    name = function.group(1).strip()
    properties = schemas.get(name, {}).get("properties", {})
    arguments = {
        key.strip(): _xml_value(value, properties.get(key.strip(), {}))
        for key, value in _PARAMETER.findall(function.group(2))
    }
    return Call(new_call_id(), name, json.dumps(arguments, ensure_ascii=False))


def _hermes(body: str) -> Call | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return Call(new_call_id(), obj["name"], json.dumps(arguments, ensure_ascii=False))


def _xml_value(raw: str, schema: dict[str, Any]) -> Any:
    if schema.get("type") == "string":
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


class ToolCallStream:
    """Splits streamed text into content deltas and whole calls. Text that may be the start of
    `<tool_call>` is held back until it is known not to be; a call is emitted when its block
    closes (its arguments in one delta, which the client's accumulation handles like many)."""

    def __init__(self, schemas: dict[str, dict[str, Any]], max_calls: int | None = None) -> None:
        self._schemas = schemas
        self._max_calls = max_calls
        self._buffer = ""
        self._in_block = False
        self.calls: list[Call] = []

    def feed(self, text: str) -> tuple[str, list[Call]]:
        """(content to emit now, calls completed by this text)."""
        self._buffer += text
        out: list[str] = []
        new: list[Call] = []
        while True:
            if not self._in_block:
                start = self._buffer.find(OPEN)
                if start < 0:
                    keep = _partial_suffix(self._buffer, OPEN)
                    out.append(self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    break
                out.append(self._buffer[:start])
                self._buffer = self._buffer[start:]
                self._in_block = True
            end = self._buffer.find(CLOSE)
            if end < 0:
                break
            block = self._buffer[: end + len(CLOSE)]
            self._buffer = self._buffer[end + len(CLOSE) :]
            self._in_block = False
            call = parse_block(block[len(OPEN) : -len(CLOSE)], self._schemas)
            if call is None:
                out.append(block)
            elif self._max_calls is None or len(self.calls) < self._max_calls:
                self.calls.append(call)
                new.append(call)
        content = "".join(out)
        if self.calls and not content.strip():
            content = ""  # whitespace between calls is not content
        return content, new

    def flush(self) -> str:
        """The stream ended: whatever is held back (an unclosed block stays text)."""
        rest, self._buffer, self._in_block = self._buffer, "", False
        return rest


def _partial_suffix(text: str, token: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `token`."""
    for k in range(min(len(token) - 1, len(text)), 0, -1):
        if text.endswith(token[:k]):
            return k
    return 0
