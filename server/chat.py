"""A chat request as the model sees it: template messages, tools, and the grammar its output must
follow (`response_format`, a forced tool call).

Messages reach the template whole: `developer` becomes `system` (the templates of the families we
serve know no developer role), an assistant turn keeps its `tool_calls` (arguments as a mapping,
which is what the templates iterate over), a tool turn keeps its `tool_call_id` and `name`.

Tools are rendered by the model's own template when it has a tool format; a template without one
(SmolLM2's) gets the Hermes-style description in its system message instead, so every model is
asked for calls in a format `ballast.server.toolcalls` parses. `tool_choice` "required" or a named
function is not left to the model: a grammar forces one call (or several, with
`parallel_tool_calls`) of the allowed tools, with arguments valid for the tool's schema.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ballast.engine.text.grammar import (
    Constraint,
    GrammarCompiler,
    GrammarError,
    json_object_schema,
)
from ballast.engine.text.tokenizer import Tokenizer, TokenizerError
from ballast.server import protocol as p
from ballast.server.answer import Reading
from ballast.server.errors import bad_request
from ballast.server.reasoning import start_of, template_thinks
from ballast.server.state import ServerState
from ballast.server.toolgrammar import style_of, tool_call_lark

TEXT_ONLY = "this model takes text only"


# Variables a request may not set through chat_template_kwargs: the server sets them itself.
_TEMPLATE_OWN = frozenset(
    {
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "tokenize",
        "chat_template",
        "continue_final_message",
    }
)


def template_messages(req: p.ChatCompletionRequest) -> list[dict[str, Any]]:
    return [_template_message(m, i) for i, m in enumerate(req.messages)]


def _template_message(m: p.ChatMessage, index: int) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": _text(m, index)}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    thought = m.reasoning_content if m.reasoning_content is not None else m.reasoning
    if thought is not None:
        out["reasoning_content"] = thought
    if m.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": _arguments(c, index)},
            }
            for c in m.tool_calls
        ]
    return out


def _text(m: p.ChatMessage, index: int) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    parts = []
    for part in m.content:
        if part.type != "text":
            raise bad_request(
                f"{TEXT_ONLY}: content parts of type '{part.type}' are not accepted",
                param=f"messages[{index}].content",
                code="unsupported_content",
            )
        parts.append(part.text or "")
    return "".join(parts)


def _arguments(call: p.ToolCall, index: int) -> dict[str, Any]:
    try:
        args = json.loads(call.function.arguments or "{}")
    except json.JSONDecodeError as exc:
        raise bad_request(
            f"tool call arguments must be a JSON object: {exc}", param=f"messages[{index}].tool_calls"
        ) from exc
    if not isinstance(args, dict):
        raise bad_request("tool call arguments must be a JSON object", param=f"messages[{index}].tool_calls")
    return args


def check_tools(req: p.ChatCompletionRequest) -> None:
    """tool_choice needs tools, and a named choice must name one of them."""
    if req.tool_choice is not None and req.tool_choice != "none" and not req.tools:
        raise bad_request("tool_choice needs tools", param="tool_choice")
    if isinstance(req.tool_choice, p.NamedToolChoice):
        names = {t.function.name for t in req.tools or ()}
        if req.tool_choice.function.name not in names:
            raise bad_request(
                f"tool_choice names `{req.tool_choice.function.name}`, which is not among the tools",
                param="tool_choice",
            )
    if req.tools and _forced(req) and req.response_format is not None and req.response_format.type != "text":
        raise bad_request(
            "response_format cannot be combined with a forced tool call", param="response_format"
        )


def reading(state: ServerState, tokenizer: Any, req: p.ChatCompletionRequest, ids: Sequence[int]) -> Reading:
    """How to read the answer: the tools it may call (each tool's name -> its parameters' JSON
    schema; one call at most without parallel_tool_calls) and where its thinking starts."""
    thinking = None
    # A grammar writes a constrained answer from its first token: no thinking comes before it.
    if (
        not wants_grammar(req)
        and isinstance(tokenizer, Tokenizer)
        and template_thinks(tokenizer.hf.chat_template, state.config.reasoning_parser)
    ):
        thinking = start_of(tokenizer.decode(ids[-_PROMPT_TAIL_TOKENS:]))
    if not req.tools or req.tool_choice == "none":
        return Reading(thinking=thinking)
    schemas = {t.function.name: t.function.parameters or {} for t in req.tools}
    single = not req.parallel_tool_calls or isinstance(req.tool_choice, p.NamedToolChoice)
    return Reading(schemas, 1 if single else None, thinking)


# Enough of the prompt's end to hold its generation prompt (`<|im_start|>assistant\n<think>\n`).
_PROMPT_TAIL_TOKENS = 16


def template_tools(req: p.ChatCompletionRequest) -> list[dict[str, Any]] | None:
    if not req.tools or req.tool_choice == "none":
        return None
    return [t.model_dump(exclude_none=True) for t in req.tools]


def describe_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For a template without a tool format: the tools and the Hermes call format in the system
    message (merged into the conversation's own system message when it has one)."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    text = (
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML "
        f"tags:\n<tools>\n{listing}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        "<args-json-object>}\n</tool_call>"
    )
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def wants_grammar(req: p.ChatCompletionRequest) -> bool:
    """The answer will be constrained (a forced tool call or a JSON response_format)."""
    return bool(req.tools and _forced(req)) or (
        req.response_format is not None and req.response_format.type != "text"
    )


def _forced(req: p.ChatCompletionRequest) -> bool:
    return req.tool_choice == "required" or isinstance(req.tool_choice, p.NamedToolChoice)


def compiler(state: ServerState) -> GrammarCompiler:
    """The grammar compiler of the loaded model's tokenizer, built on first use."""
    engine = state.engine
    if state.grammars is None and engine is not None:  # two first requests may both build one: one is kept
        state.grammars = engine.tokenizer.grammar_compiler(engine.vocab_size)
    if state.grammars is None:
        raise bad_request("structured outputs need a model with its own tokenizer", param="response_format")
    return state.grammars


def constraint(state: ServerState, req: p.ChatCompletionRequest, prompt_tokens: int) -> Constraint | None:
    """The grammar the answer must follow, or None when it is free text."""
    try:
        if req.tools and _forced(req):
            grammars = compiler(state)
            allowed = req.tools
            if isinstance(req.tool_choice, p.NamedToolChoice):
                allowed = [t for t in req.tools if t.function.name == req.tool_choice.function.name]
            assert state.engine is not None  # compiler() refuses a missing one
            style = style_of(state.engine.tokenizer.chat_template)
            several = req.parallel_tool_calls and req.tool_choice == "required"
            return grammars.constraint(grammars.lark(tool_call_lark(allowed, style, several)), prompt_tokens)
        fmt = req.response_format
        if fmt is None or fmt.type == "text":
            return None
        grammars = compiler(state)
        schema = json_object_schema() if fmt.json_schema is None else fmt.json_schema.schema_
        return grammars.constraint(grammars.json_schema(schema), prompt_tokens)
    except GrammarError as exc:
        param = "tools" if req.tools and _forced(req) else "response_format"
        raise bad_request(str(exc), param=param, code="invalid_schema") from exc


def template_kwargs(req: p.ChatCompletionRequest) -> dict[str, Any]:
    kwargs = req.chat_template_kwargs or {}
    own = sorted(_TEMPLATE_OWN.intersection(kwargs))
    if own:
        raise bad_request(
            f"chat_template_kwargs may not set `{own[0]}`: the server sets it", param="chat_template_kwargs"
        )
    return kwargs


def chat_prompt(state: ServerState, tokenizer: Any, req: p.ChatCompletionRequest) -> list[int]:
    """The prompt's token ids: messages and tools through the model's template."""
    messages = template_messages(req)
    tools = template_tools(req)
    if not isinstance(tokenizer, Tokenizer):
        return list(tokenizer.apply_chat_template(messages))
    if tools and not tokenizer.template_knows_tools:
        messages, tools = describe_tools(messages, tools), None
    try:
        return tokenizer.apply_chat_template(
            messages,
            tools,
            special_tokens_in_content=state.config.special_tokens_in_chat,
            template_kwargs=template_kwargs(req),
        )
    except TokenizerError as exc:  # the template refused this conversation (its shape, its roles)
        raise bad_request(str(exc), param="messages") from exc
