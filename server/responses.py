"""OpenAI Responses (`POST /v1/responses`), stateless, as a translation of the request into a chat
request: the same template, grammar, tool parsers, scheduler and refusals serve it. What comes
back is written by `ballast.server.responses_out`.

The request maps as: `instructions` -> a system message; `input` text -> a user message; input
items: messages (input_text / output_text parts) -> chat messages, `function_call` items -> the
assistant turn's calls, `function_call_output` -> tool messages, `reasoning` items -> the next
assistant turn's reasoning; function `tools` and `tool_choice` as in chat; `text.format`
json_schema / json_object -> response_format; `max_output_tokens` -> max_tokens;
`reasoning.effort` "none" -> the template's `enable_thinking: false`.

Nothing is kept after the answer: `store: true`, `previous_response_id`, `conversation` and
`background` are refused with a 400 saying to send the whole conversation as `input`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from ballast.server import protocol as p
from ballast.server.errors import bad_request
from pydantic import Field

Item = dict[str, Any]
STATELESS = "this server keeps no responses: send the whole conversation as `input`"


class ResponsesTool(p._Request):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(p._Request):
    type: Literal["function"]
    name: str


class ResponsesRequest(p._Request):
    model: str
    input: str | list[Item]
    instructions: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


def to_chat(req: ResponsesRequest) -> p.ChatCompletionRequest:
    """The chat request that generates this Responses request's answer."""
    for name in ("store", "previous_response_id", "conversation", "background"):
        value = (
            getattr(req, name, None) if name in type(req).model_fields else (req.model_extra or {}).get(name)
        )
        if value not in (None, False):
            raise bad_request(
                f"`{name}` is not supported: {STATELESS}", param=name, code="unsupported_parameter"
            )
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    messages += [{"role": "user", "content": req.input}] if isinstance(req.input, str) else _items(req.input)
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "stream": req.stream,
        "parallel_tool_calls": req.parallel_tool_calls,
    }
    if req.tools:
        body["tools"] = [_tool(t, i) for i, t in enumerate(req.tools)]
    if isinstance(req.tool_choice, NamedFunctionChoice):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    if req.text is not None:
        body["response_format"] = _format(req.text)
    if req.reasoning is not None and req.reasoning.get("effort") == "none":
        body["chat_template_kwargs"] = {"enable_thinking": False}
    try:
        return p.ChatCompletionRequest.model_validate(body)
    except ValueError as exc:
        raise bad_request(str(exc).splitlines()[0]) from exc


def _items(items: list[Item]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # call id -> the function's name, for the tool messages
    thought: str | None = None
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request("an input item must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(
                    "a message's role must be user, system, developer or assistant", param=f"{where}.role"
                )
            message: dict[str, Any] = {
                "role": role,
                "content": _text(item.get("content"), f"{where}.content"),
            }
            if role == "assistant" and thought is not None:
                message["reasoning_content"], thought = thought, None
            out.append(message)
        elif kind == "function_call":
            call_id, name = _str(item, "call_id", where), _str(item, "name", where)
            names[call_id] = name
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": _str(item, "arguments", where)},
            }
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                if thought is not None:
                    last["reasoning_content"], thought = thought, None
                out.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            call_id = _str(item, "call_id", where)
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, f"{where}.output")
            tool: dict[str, Any] = {"role": "tool", "tool_call_id": call_id, "content": text}
            if call_id in names:
                tool["name"] = names[call_id]
            out.append(tool)
        elif kind == "reasoning":
            pieces = item.get("content") or item.get("summary") or []
            thought = "".join(str(piece.get("text", "")) for piece in pieces if isinstance(piece, dict))
        else:
            raise bad_request(f"input items of type '{kind}' are not accepted", param=f"{where}.type")
    if not out:
        raise bad_request("input holds no message", param="input")
    return out


def _text(content: object, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request("expected text or a list of text parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text", "refusal"):
            raise bad_request(
                f"this model takes text only: content parts of type '{kind}' are not accepted",
                param=f"{where}[{j}]",
            )
        texts.append(str(part.get("text", part.get("refusal", ""))))
    return "".join(texts)


def _str(item: Item, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"a {item.get('type')} item needs a string `{key}`", param=f"{where}.{key}")
    return value


def _tool(tool: ResponsesTool, index: int) -> dict[str, Any]:
    if tool.type != "function" or not tool.name:
        raise bad_request(
            f"only function tools with a name are supported (not '{tool.type}')", param=f"tools[{index}]"
        )
    function = {
        "name": tool.name,
        "description": tool.description,
        "parameters": tool.parameters,
        "strict": tool.strict,
    }
    return {"type": "function", "function": function}


def _format(text: dict[str, Any]) -> dict[str, Any]:
    fmt = text.get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise bad_request("text.format.type must be text, json_schema or json_object", param="text.format.type")


def echo_fields(req: ResponsesRequest) -> dict[str, Any]:
    """The request's settings a Response states back."""
    choice = (
        req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedFunctionChoice) else req.tool_choice
    )
    return {
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {},
        "parallel_tool_calls": req.parallel_tool_calls,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tool_choice": choice or "auto",
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
        "text": req.text or {"format": {"type": "text"}},
        "store": False,
        "previous_response_id": None,
        "reasoning": req.reasoning or {"effort": None, "summary": None},
        "truncation": "disabled",
        "user": (req.model_extra or {}).get("user"),
    }
