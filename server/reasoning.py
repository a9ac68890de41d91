"""Thinking split out of the answer: what a reasoning model writes between `<think>` and
`</think>` (Qwen3, Qwen3-Next-Thinking, Qwen3.5, DeepSeek-R1) is reasoning, the rest is the answer.

Which models think is read off the chat template (one that writes `</think>`), or set by the
operator where the template cannot tell (`--reasoning-parser think` / `none`). Where thinking
starts is read off the rendered prompt: a template that opens `<think>` in its generation prompt
(the Thinking models) makes the answer start inside the thinking; one that writes an empty
`<think></think>` there (Qwen3 with `enable_thinking: false`) makes it start after; otherwise the
model opens it, or does not, itself.

The whitespace around the thinking (the newlines the templates put after `<think>`, before and
after `</think>`) belongs to neither part.
"""

from __future__ import annotations

from typing import Literal

from ballast.server.parts import Part, Text, Thought
from ballast.server.toolcalls import partial_suffix

THINK, END_THINK = "<think>", "</think>"
Start = Literal["thinking", "maybe", "answer"]


def template_thinks(chat_template: str | None, parser: str) -> bool:
    """`parser`: the operator's setting, "auto", "think" or "none"."""
    if parser != "auto":
        return parser == "think"
    return bool(chat_template) and END_THINK in str(chat_template)


def start_of(prompt_tail: str) -> Start:
    """Where the answer starts, from the end of the rendered prompt."""
    opened, closed = prompt_tail.rfind(THINK), prompt_tail.rfind(END_THINK)
    if opened > closed:
        return "thinking"
    return "answer" if closed >= 0 and not prompt_tail[closed + len(END_THINK) :].strip() else "maybe"


class ThinkSplitter:
    """Streamed text -> Thought and Text parts; text that may be the start of a tag waits."""

    def __init__(self, start: Start) -> None:
        self._state: Literal["maybe", "thinking", "after", "answer"] = start
        self._buffer = ""
        self._thought_started = False

    def feed(self, text: str) -> list[Part]:
        self._buffer += text
        out: list[Part] = []
        while self._buffer:
            if self._state == "maybe":
                lead = self._buffer.lstrip()
                if lead.startswith(THINK):
                    self._buffer, self._state = lead[len(THINK) :], "thinking"
                    continue
                if THINK.startswith(lead):  # "", "<", "<th", ...: not yet known
                    break
                self._state = "answer"
            if self._state == "answer":
                out.append(Text(self._buffer))
                self._buffer = ""
                break
            if self._state == "after":
                self._buffer = self._buffer.lstrip()
                if self._buffer:
                    self._state = "answer"
                continue
            end = self._buffer.find(END_THINK)
            if end >= 0:
                out += self._thought(self._buffer[:end].rstrip())
                self._buffer, self._state = self._buffer[end + len(END_THINK) :], "after"
                continue
            # Hold a tail that may start "</think>", and trailing whitespace (it may precede it).
            sure = self._buffer[: len(self._buffer) - partial_suffix(self._buffer, END_THINK)]
            sure = sure.rstrip()
            out += self._thought(sure)
            self._buffer = self._buffer[len(sure) :]
            break
        return out

    def finish(self) -> list[Part]:
        """The answer ended: what was held back (thinking cut off stays thinking)."""
        rest, self._buffer = self._buffer, ""
        if self._state == "thinking":
            return self._thought(rest.rstrip())
        return [Text(rest)] if rest.strip() or (rest and self._state == "answer") else []

    def _thought(self, text: str) -> list[Part]:
        if not self._thought_started:
            text = text.lstrip()
        if not text:
            return []
        self._thought_started = True
        return [Thought(text)]
