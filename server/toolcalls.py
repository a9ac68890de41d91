"""Tool calls in a model's text: the formats the served families' chat templates write, read into
calls whose arguments stream as they are generated (`ToolCallStream`), or whole (`parse`).

Both formats wrap each call in `<tool_call>` ... `</tool_call>`:
- Hermes style (Qwen2.5, Qwen3, Qwen3-Next, and what ballast asks of models whose template has no
  tool format): a JSON object `{"name": ..., "arguments": {...}}`. Once the name is read, the
  arguments object's text goes out piece by piece as the model writes it, so the call's arguments
  are the model's own JSON text.
- Qwen3.5 (and Qwen3-Coder): `<function=NAME>` with one `<parameter=KEY>` block per argument,
  whose value is the raw text for a string and JSON for anything else. Each parameter goes out as
  a JSON member when its block closes.
The body decides which one it is, so a model may answer in either. A block that parses as
neither stays in the content, as the model wrote it; one whose head did not show the name first
goes out whole when it closes. An answer cut off inside a call (finish "length") ends with that
call as far as it got: a truncated call, never its markup as content.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from ballast.server.parts import Call, CallArguments, CallClosed, CallOpened, Part, Text

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
_HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\{)')
_XML_HEAD = re.compile(r"\s*<function=([^>\n]+)>")
_PARTIAL_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)')
_PARTIAL_FUNCTION = re.compile(r"\s*<function=([^>\n]*)\Z")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse(text: str, schemas: dict[str, dict[str, Any]]) -> tuple[str | None, list[Call]]:
    """(content, calls) of a whole answer that ended on its own (not cut off)."""
    stream = ToolCallStream(schemas)
    parts = stream.feed(text) + stream.finish(truncated=False)
    calls = [p.call for p in parts if isinstance(p, CallClosed)]
    content = "".join(p.text for p in parts if isinstance(p, Text))
    return ((content.strip() if calls else content) or None), calls


def parse_block(body: str, schemas: dict[str, dict[str, Any]]) -> Call | None:
    """One call from the text between <tool_call> and </tool_call>; None if it is not one.
    `schemas` maps each tool's name to its parameters' JSON schema, which says which XML-style
    values are strings."""
    body = body.strip()
    if body.startswith("{"):
        return _hermes(body)
    function = _FUNCTION.fullmatch(body)
    if function is None:
        return None
    name = function.group(1).strip()
    members = [_member(k, v, schemas.get(name, {})) for k, v in _PARAMETER.findall(function.group(2))]
    return Call(new_call_id(), name, "{" + ", ".join(members) + "}")


def _member(key: str, raw: str, parameters: dict[str, Any]) -> str:
    key = key.strip()
    value = _xml_value(raw, parameters.get("properties", {}).get(key, {}))
    return f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"


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


class _ObjectEnd:
    """Finds where a JSON object ends in text fed to it piece by piece (strings and escapes
    respected), without parsing it."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.done = False

    def feed(self, text: str) -> int:
        """How much of `text` belongs to the object (all of it, until the object closes)."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)


class _Block:
    """The call being read: the text after `<tool_call>` so far, and what of it went out."""

    def __init__(self, index: int, dropped: bool) -> None:
        self.index = index
        self.body = ""
        self.dropped = dropped  # beyond max_calls: read to its end, never sent
        self.call_id: str | None = None  # set once the call is opened
        self.name = ""
        self.scanned = 0  # body characters looked at for the arguments
        self.arguments = ""  # the arguments text sent so far
        self.hermes: _ObjectEnd | None = None
        self.members = 0  # XML parameters sent

    def advance(self, schemas: dict[str, dict[str, Any]]) -> list[Part]:
        """Open the call once its name shows, and send what is sure of its arguments."""
        out: list[Part] = []
        if self.call_id is None:
            head = _HERMES_HEAD.match(self.body)
            if head is not None:
                self.name, self.hermes = json.loads(head.group(1)), _ObjectEnd()
            else:
                head = _XML_HEAD.match(self.body)
                if head is None:
                    return out
                self.name = head.group(1).strip()
            self.call_id, self.scanned = new_call_id(), head.end()
            out.append(CallOpened(self.index, self.call_id, self.name))
        if self.hermes is not None:
            ready = self.body[self.scanned :]
            if ready and not self.hermes.done:
                piece = ready[: self.hermes.feed(ready)]
                self.scanned += len(ready)
                out += self._send(piece)
            return out
        params = list(_PARAMETER.finditer(self.body, self.scanned))
        for match in params:
            lead = "{" if self.members == 0 else ", "
            out += self._send(lead + _member(match.group(1), match.group(2), schemas.get(self.name, {})))
            self.members += 1
        if params:
            self.scanned = params[-1].end()
        return out

    def _send(self, piece: str) -> list[Part]:
        if not piece:
            return []
        self.arguments += piece
        return [CallArguments(self.index, piece)]

    def close(self) -> list[Part]:
        """The call's end (its block closed, or the answer was cut off inside it)."""
        assert self.call_id is not None
        out: list[Part] = []
        if self.hermes is None:
            out += self._send("}" if self.members else "{}")
        out.append(CallClosed(self.index, Call(self.call_id, self.name, self.arguments)))
        return out


class ToolCallStream:
    """Splits streamed text into content and calls. Text that may be the start of `<tool_call>`
    is held back until it is known not to be; whitespace between calls is not content."""

    def __init__(self, schemas: dict[str, dict[str, Any]], max_calls: int | None = None) -> None:
        self._schemas = schemas
        self._max_calls = max_calls
        self._buffer = ""  # text outside a block not yet sent
        self._block: _Block | None = None
        self.calls: list[Call] = []

    def feed(self, text: str) -> list[Part]:
        out: list[Part] = []
        self._buffer += text
        while self._buffer:
            if self._block is None:
                start = self._buffer.find(OPEN)
                if start < 0:
                    keep = partial_suffix(self._buffer, OPEN)
                    out += self._content(self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    break
                out += self._content(self._buffer[:start])
                self._buffer = self._buffer[start + len(OPEN) :]
                full = self._max_calls is not None and len(self.calls) >= self._max_calls
                self._block = _Block(len(self.calls), dropped=full)
            block = self._block
            end = self._buffer.find(CLOSE)
            if end < 0:  # the body so far; a tail that may start the close tag waits
                keep = partial_suffix(self._buffer, CLOSE)
                block.body += self._buffer[: len(self._buffer) - keep]
                self._buffer = self._buffer[len(self._buffer) - keep :]
                if not block.dropped:
                    out += block.advance(self._schemas)
                break
            block.body += self._buffer[:end]
            self._buffer = self._buffer[end + len(CLOSE) :]
            self._block = None
            out += self._closed(block)
        return out

    def finish(self, truncated: bool) -> list[Part]:
        """The answer ended; `truncated`: cut off by max_tokens (an open call ends as it is)."""
        block, self._block = self._block, None
        rest, self._buffer = self._buffer, ""
        if block is None:
            return self._content(rest)
        if block.dropped:
            return []
        if truncated and block.call_id is None:
            opened = self._truncated_head(block)
            if opened is not None:
                return [opened, *self._record(block.close())]
        if truncated and block.call_id is not None:
            out = block.advance(self._schemas)
            return out + self._record(block.close())
        if block.call_id is None:
            return self._content(OPEN + block.body)
        return self._record(block.close())  # ended without its close tag: what it sent stands

    def _closed(self, block: _Block) -> list[Part]:
        if block.dropped:
            return []
        opened = block.advance(self._schemas)  # a call fed whole reads as a streamed one does
        if block.call_id is not None:
            return opened + self._record(block.close())
        call = parse_block(block.body, self._schemas)
        if call is None:
            return self._content(OPEN + block.body + CLOSE)
        parts: list[Part] = [
            CallOpened(block.index, call.id, call.name),
            CallArguments(block.index, call.arguments),
            CallClosed(block.index, call),
        ]
        return self._record(parts)

    def _truncated_head(self, block: _Block) -> CallOpened | None:
        """A call cut off before its name was whole: the tool it can only be, if any."""
        hermes = _PARTIAL_NAME.match(block.body)
        xml = None if hermes is not None else _PARTIAL_FUNCTION.match(block.body)
        if hermes is None and xml is None and block.body.strip():
            return None
        head = hermes or xml
        start = head.group(1) if head is not None else ""
        names = [start] if start in self._schemas else [n for n in self._schemas if n.startswith(start)]
        if len(names) != 1:
            return None
        block.call_id, block.name = new_call_id(), names[0]
        block.hermes = None if xml is not None else _ObjectEnd()
        return CallOpened(block.index, block.call_id, block.name)

    def _record(self, parts: list[Part]) -> list[Part]:
        self.calls += [p.call for p in parts if isinstance(p, CallClosed)]
        return parts

    def _content(self, text: str) -> list[Part]:
        if not text or (self.calls and not text.strip()):
            return []
        return [Text(text)]


def partial_suffix(text: str, token: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `token`."""
    for k in range(min(len(token) - 1, len(text)), 0, -1):
        if text.endswith(token[:k]):
            return k
    return 0
