"""Thinking split from the answer, streamed in any split, and read together with tool calls."""

from __future__ import annotations

import json

import pytest
from ballast.server.answer import AnswerStream, Reading, read_whole
from ballast.server.parts import CallArguments, CallClosed, Part, Text, Thought
from ballast.server.reasoning import ThinkSplitter, start_of, template_thinks

QWEN3 = "<think>\nThe user wants 2+2.\nThat is 4.\n</think>\n\nIt is 4."


def _split(text: str, start: str, step: int) -> tuple[str, str]:
    splitter = ThinkSplitter(start)  # type: ignore[arg-type]
    parts: list[Part] = []
    for i in range(0, len(text), step):
        parts += splitter.feed(text[i : i + step])
    parts += splitter.finish()
    thought = "".join(p.text for p in parts if isinstance(p, Thought))
    answer = "".join(p.text for p in parts if isinstance(p, Text))
    return thought, answer


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_the_model_opens_its_thinking(step: int) -> None:
    assert _split(QWEN3, "maybe", step) == ("The user wants 2+2.\nThat is 4.", "It is 4.")


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_the_prompt_opened_the_thinking(step: int) -> None:
    assert _split("\nhmm </thin> no\n</think>\n\nYes.", "thinking", step) == ("hmm </thin> no", "Yes.")


@pytest.mark.parametrize("step", [1, 1000])
def test_no_thinking_is_all_answer_and_cut_off_thinking_stays_thinking(step: int) -> None:
    assert _split("  <thin is not a tag", "maybe", step) == ("", "  <thin is not a tag")
    assert _split("<think>\nstill going", "maybe", step) == ("still going", "")
    assert _split("Plain.", "answer", step) == ("", "Plain.")


def test_where_thinking_starts_is_read_off_the_prompt() -> None:
    assert start_of("<|im_start|>assistant\n<think>\n") == "thinking"
    assert start_of("<|im_start|>assistant\n<think>\n\n</think>\n\n") == "answer"
    assert start_of("<|im_start|>assistant\n") == "maybe"
    assert start_of("<think>a</think>b<|im_start|>assistant\n") == "maybe"  # an earlier turn's


def test_which_templates_think() -> None:
    assert template_thinks("{{ '<think>' }}...{{ '</think>' }}", "auto")
    assert not template_thinks("{{ message.content }}", "auto")
    assert template_thinks(None, "think")
    assert not template_thinks("</think>", "none")


def test_a_call_in_the_thinking_is_a_thought_and_one_after_it_a_call() -> None:
    schemas = {"f": {"type": "object", "properties": {"x": {"type": "integer"}}}}
    call = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    text = f"<think>maybe {call}</think>\n{call}"
    reading = Reading(schemas, None, "maybe")
    answer = read_whole(reading, text, truncated=False)
    assert answer.reasoning == f"maybe {call}"
    assert answer.content is None
    assert [(c.name, json.loads(c.arguments)) for c in answer.calls] == [("f", {"x": 1})]
    stream = AnswerStream(reading)
    parts = [p for i in range(len(text)) for p in stream.feed(text[i])] + stream.finish(False)
    pieces = "".join(p.text for p in parts if isinstance(p, CallArguments))
    [closed] = [p for p in parts if isinstance(p, CallClosed)]
    assert pieces == closed.call.arguments == answer.calls[0].arguments
