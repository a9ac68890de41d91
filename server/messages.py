"""Anthropic Messages (`POST /v1/messages`, `/v1/messages/count_tokens`), as a translation of
the request into a chat request: the same template, grammar, tool parsers, scheduler and refusals
serve it. What comes back is written by `ballast.server.messages_out`.

The request maps as: `system` (text or text blocks) -> a system message; user text blocks -> user
content, `tool_result` blocks -> tool messages answering their `tool_use_id`; assistant text,
`tool_use` and `thinking` blocks -> the assistant turn's content, calls and reasoning; `tools` ->
function tools; `tool_choice` auto / any / tool / none -> auto / required / named / none
(`disable_parallel_tool_use` -> one call at most); `stop_sequences` -> stop; `thinking`
enabled / disabled -> the template's `enable_thinking`; `output_config.format` (a JSON schema) ->
response_format. Images, documents and server tools are
refused with a 400 naming the block: this server serves text models.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from ballast.server import protocol as p
from ballast.server.errors import bad_request
from pydantic import Field

Block = dict[str, Any]
TEXT_ONLY = "this model takes text only"


class MessagesTool(p._Request):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    type: str | None = None  # "custom" or absent; Anthropic's server tools name a version here


class MessagesToolChoice(p._Request):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class InputMessage(p._Request):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class MessagesRequest(p._Request):
    model: str
    max_tokens: Annotated[int, Field(ge=1)]
    messages: Annotated[list[InputMessage], Field(min_length=1)]
    system: str | list[Block] | None = None
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    stream: bool = False
    tools: list[MessagesTool] | None = None
    tool_choice: MessagesToolChoice | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # {"format": {"type": "json_schema", "schema": ...}}


class CountTokensRequest(p._Request):
    model: str
    messages: Annotated[list[InputMessage], Field(min_length=1)]
    system: str | list[Block] | None = None
    tools: list[MessagesTool] | None = None
    tool_choice: MessagesToolChoice | None = None
    thinking: dict[str, Any] | None = None


def to_chat(req: MessagesRequest | CountTokensRequest) -> p.ChatCompletionRequest:
    """The chat request that generates this Messages request's answer."""
    body: dict[str, Any] = {"model": req.model, "messages": _messages(req)}
    if req.tools:
        body["tools"] = [_tool(t, i) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        body.update(_tool_choice(req.tool_choice))
    if req.thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": _thinking(req.thinking)}
    if isinstance(req, MessagesRequest) and req.output_config is not None:
        body["response_format"] = _output_format(req.output_config)
    if isinstance(req, MessagesRequest):
        body.update(
            max_tokens=req.max_tokens,
            stop=req.stop_sequences or None,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            stream=req.stream,
        )
    try:
        return p.ChatCompletionRequest.model_validate(body)
    except ValueError as exc:  # a tool or choice that passed here and fails the chat checks
        raise bad_request(str(exc).splitlines()[0]) from exc


def _messages(req: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if req.system is not None:
        out.append({"role": "system", "content": _text_of(req.system, "system")})
    for i, message in enumerate(req.messages):
        where = f"messages[{i}].content"
        blocks: list[Block] = (
            [{"type": "text", "text": message.content}]
            if isinstance(message.content, str)
            else message.content
        )
        if message.role == "assistant":
            out.append(_assistant(blocks, where))
        else:
            out += _user(blocks, where)
    return out


def _assistant(blocks: list[Block], where: str) -> dict[str, Any]:
    texts, thoughts, calls = [], [], []
    for j, block in enumerate(blocks):
        kind = _kind(block, f"{where}[{j}]")
        if kind == "text":
            texts.append(_str(block, "text", f"{where}[{j}]"))
        elif kind in ("thinking", "redacted_thinking"):
            thoughts.append(str(block.get("thinking", "")))
        elif kind == "tool_use":
            arguments = block.get("input", {})
            if not isinstance(arguments, dict):
                raise bad_request("a tool_use block's input must be an object", param=f"{where}[{j}].input")
            calls.append(
                {
                    "id": _str(block, "id", f"{where}[{j}]"),
                    "type": "function",
                    "function": {
                        "name": _str(block, "name", f"{where}[{j}]"),
                        "arguments": json.dumps(arguments),
                    },
                }
            )
        else:
            raise _unsupported(kind, f"{where}[{j}]")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    if thoughts:
        message["reasoning_content"] = "".join(thoughts)
    return message


def _user(blocks: list[Block], where: str) -> list[dict[str, Any]]:
    """A user turn: tool results become tool messages (first, as the calls they answer came just
    before), the text the user message after them."""
    results: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        kind = _kind(block, f"{where}[{j}]")
        if kind == "text":
            texts.append(_str(block, "text", f"{where}[{j}]"))
        elif kind == "tool_result":
            content = block.get("content", "")
            text = _text_of(content, f"{where}[{j}].content") if content is not None else ""
            if block.get("is_error"):
                text = f"Error: {text}"
            results.append(
                {"role": "tool", "tool_call_id": _str(block, "tool_use_id", f"{where}[{j}]"), "content": text}
            )
        else:
            raise _unsupported(kind, f"{where}[{j}]")
    return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])


def _text_of(content: object, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request("expected a string or a list of text blocks", param=where)
    parts = []
    for j, block in enumerate(content):
        kind = _kind(block, f"{where}[{j}]")
        if kind != "text":
            raise _unsupported(kind, f"{where}[{j}]")
        parts.append(_str(block, "text", f"{where}[{j}]"))
    return "\n".join(parts) if where == "system" else "".join(parts)


def _kind(block: object, where: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise bad_request("a content block must be an object with a string `type`", param=where)
    return str(block["type"])


def _str(block: Block, key: str, where: str) -> str:
    value = block.get(key)
    if not isinstance(value, str):
        raise bad_request(f"a {block['type']} block needs a string `{key}`", param=f"{where}.{key}")
    return value


def _unsupported(kind: str, where: str) -> Exception:
    if kind in ("image", "document", "search_result"):
        return bad_request(f"{TEXT_ONLY}: content blocks of type '{kind}' are not accepted", param=where)
    return bad_request(f"content blocks of type '{kind}' are not accepted here", param=where)


def _tool(tool: MessagesTool, index: int) -> dict[str, Any]:
    if tool.type not in (None, "custom"):
        raise bad_request(
            f"server tools ({tool.type}) are not supported; give custom tools with an input_schema",
            param=f"tools[{index}].type",
        )
    return {
        "type": "function",
        "function": {"name": tool.name, "description": tool.description, "parameters": tool.input_schema},
    }


def _tool_choice(choice: MessagesToolChoice) -> dict[str, Any]:
    picked: Any = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type)
    if choice.type == "tool":
        if not choice.name:
            raise bad_request("tool_choice of type tool needs a name", param="tool_choice.name")
        picked = {"type": "function", "function": {"name": choice.name}}
    return {"tool_choice": picked, "parallel_tool_calls": not choice.disable_parallel_tool_use}


def _thinking(thinking: dict[str, Any]) -> bool:
    kind = thinking.get("type")
    if kind not in ("enabled", "disabled", "adaptive"):
        raise bad_request("thinking.type must be enabled, disabled or adaptive", param="thinking.type")
    return kind != "disabled"


def _output_format(config: dict[str, Any]) -> dict[str, Any] | None:
    """Anthropic's structured outputs: a JSON schema the answer's text is held to."""
    fmt = config.get("format")
    if fmt is None:
        return None
    if (
        not isinstance(fmt, dict)
        or fmt.get("type") != "json_schema"
        or not isinstance(fmt.get("schema"), dict)
    ):
        raise bad_request(
            "output_config.format must be {type: json_schema, schema: {...}}", param="output_config.format"
        )
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
