"""Tool calls read out of model text: both formats, whole and streamed in any split."""

from __future__ import annotations

import json

import pytest
from ballast.server import protocol as p
from ballast.server.chat import template_messages
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


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_streamed_in_any_split_gives_the_same_calls_and_content(step: int) -> None:
    for text in (HERMES, XML, "plain <tool text with a < sign"):
        stream = ToolCallStream(SCHEMAS)
        content = ""
        for i in range(0, len(text), step):
            piece, _ = stream.feed(text[i : i + step])
            content += piece
        content += stream.flush()
        whole_content, whole_calls = parse(text, SCHEMAS)
        assert [(c.name, c.arguments) for c in stream.calls] == [(c.name, c.arguments) for c in whole_calls]
        assert content.strip() == (whole_content or "")


def test_max_calls_keeps_the_first() -> None:
    stream = ToolCallStream(SCHEMAS, max_calls=1)
    stream.feed(XML)
    assert [json.loads(c.arguments)["city"] for c in stream.calls] == ["42 rue"]


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
