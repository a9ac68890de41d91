"""Tool calls read out of model text: both formats, whole and streamed in any split."""

from __future__ import annotations

import json

import pytest
from ballast.server import protocol as p
from ballast.server.chat import template_messages
from ballast.server.parts import CallArguments, CallClosed, CallOpened, Part, Text
from ballast.server.toolcalls import ToolCallStream, parse

SCHEMAS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
}
HERMES = (
    "Let me look.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
)
XML = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\n42 "
    "rue\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
    "</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>"
)


def test_hermes_call_and_the_content_before_it() -> None:
    content, calls = parse(HERMES, SCHEMAS)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 3})
    ]


def test_qwen35_xml_calls_take_string_values_raw_and_others_as_json() -> None:
    content, calls = parse(XML, SCHEMAS)
    assert content is None
    assert [json.loads(c.arguments) for c in calls] == [{"city": "42 rue", "days": 3}, {"city": "Rome"}]
    assert len({c.id for c in calls}) == 2


def test_a_block_that_is_no_call_stays_text() -> None:
    text = "see <tool_call>\nnot json\n</tool_call> here"
    assert parse(text, SCHEMAS) == (text, [])


def _streamed(text: str, step: int, truncated: bool = False, max_calls: int | None = None) -> list[Part]:
    stream = ToolCallStream(SCHEMAS, max_calls)
    parts: list[Part] = []
    for i in range(0, len(text), step):
        parts += stream.feed(text[i : i + step])
    return parts + stream.finish(truncated)


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_streamed_in_any_split_gives_the_same_calls_and_content(step: int) -> None:
    for text in (HERMES, XML, "plain <tool text with a < sign"):
        parts = _streamed(text, step)
        calls = [p.call for p in parts if isinstance(p, CallClosed)]
        content = "".join(p.text for p in parts if isinstance(p, Text))
        whole_content, whole_calls = parse(text, SCHEMAS)
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole_calls]
        assert content.strip() == (whole_content or "")


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_arguments_stream_as_generated_and_add_up_to_the_call(step: int) -> None:
    for text in (HERMES, XML):
        parts = _streamed(text, step)
        calls = [p.call for p in parts if isinstance(p, CallClosed)]
        for index, call in enumerate(calls):
            opened = [p for p in parts if isinstance(p, CallOpened) and p.index == index]
            pieces = [p.text for p in parts if isinstance(p, CallArguments) and p.index == index]
            assert [(o.id, o.name) for o in opened] == [(call.id, call.name)]
            assert "".join(pieces) == call.arguments
            json.loads(call.arguments)
            # The opening comes before any piece, and a streamed call comes in several pieces.
            assert parts.index(opened[0]) < min(
                i for i, p in enumerate(parts) if isinstance(p, CallArguments) and p.index == index
            )
            if step == 1 and text is HERMES:
                assert len(pieces) == len(call.arguments)


def test_hermes_arguments_are_the_models_own_text() -> None:
    text = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo","days":2}}\n</tool_call>'
    [call] = parse(text, SCHEMAS)[1]
    assert call.arguments == '{"city":"Oslo","days":2}'


@pytest.mark.parametrize(
    ("cut", "name", "arguments"),
    [
        ('<tool_call>\n{"name": "get_', "get_weather", ""),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', "get_weather", '{"city": "Pa'),
        (
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<param",
            "get_weather",
            '{"city": "Rome"}',
        ),
    ],
)
def test_a_call_cut_off_by_max_tokens_is_a_call_without_markup(cut: str, name: str, arguments: str) -> None:
    for step in (1, 1000):
        parts = _streamed(cut, step, truncated=True)
        assert not [p for p in parts if isinstance(p, Text)]
        [closed] = [p for p in parts if isinstance(p, CallClosed)]
        assert (closed.call.name, closed.call.arguments) == (name, arguments)


def test_an_unclosed_block_that_ended_by_itself_stays_text() -> None:
    parts = _streamed("so <tool_call> maybe", 3)
    assert "".join(p.text for p in parts if isinstance(p, Text)) == "so <tool_call> maybe"


def test_max_calls_keeps_the_first() -> None:
    calls = [p.call for p in _streamed(XML, 5, max_calls=1) if isinstance(p, CallClosed)]
    assert [json.loads(c.arguments)["city"] for c in calls] == ["42 rue"]


def test_template_messages_keep_tool_turns_whole() -> None:
    req = p.ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "developer", "content": "be brief"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny"},
            ],
        }
    )
    assert template_messages(req) == [
        {"role": "system", "content": "be brief"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
                }
            ],
        },
        {"role": "tool", "content": "sunny", "name": "get_weather", "tool_call_id": "call_1"},
    ]
