"""One reading of a model's answer for every API: thinking split off first (tool calls inside the
thinking are thoughts, not calls), then tool calls read out of the rest. Streamed answers are
read piece by piece; a whole answer is the same stream fed at once, so both give the same parts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ballast.server.parts import Call, CallClosed, Part, Text, Thought
from ballast.server.reasoning import Start, ThinkSplitter
from ballast.server.toolcalls import ToolCallStream


@dataclass(frozen=True)
class Reading:
    """How to read an answer: the tools it may call, and where its thinking starts (None: the
    model does not think, or the operator turned the parser off)."""

    schemas: dict[str, dict[str, Any]] | None = None  # tool name -> its parameters' JSON schema
    max_calls: int | None = None
    thinking: Start | None = None

    @property
    def plain(self) -> bool:
        """Nothing to read out: the text goes out as it is."""
        return self.schemas is None and self.thinking is None


class AnswerStream:
    def __init__(self, reading: Reading) -> None:
        self._think = ThinkSplitter(reading.thinking) if reading.thinking is not None else None
        self._tools = (
            ToolCallStream(reading.schemas, reading.max_calls) if reading.schemas is not None else None
        )

    def feed(self, text: str) -> list[Part]:
        parts: list[Part] = self._think.feed(text) if self._think is not None else [Text(text)]
        return self._calls(parts)

    def finish(self, truncated: bool) -> list[Part]:
        """The answer ended; `truncated`: by max_tokens (a call cut short is still a call)."""
        parts = self._calls(self._think.finish()) if self._think is not None else []
        if self._tools is not None:
            parts += self._tools.finish(truncated)
        return parts

    @property
    def calls(self) -> list[Call]:
        return self._tools.calls if self._tools is not None else []

    def _calls(self, parts: list[Part]) -> list[Part]:
        if self._tools is None:
            return parts
        out: list[Part] = []
        for part in parts:
            out += self._tools.feed(part.text) if isinstance(part, Text) else [part]
        return out


@dataclass(frozen=True)
class Answer:
    reasoning: str | None
    content: str | None  # None when there is no text (a call alone, or nothing at all)
    calls: list[Call]


def read_whole(reading: Reading, text: str, truncated: bool) -> Answer:
    stream = AnswerStream(reading)
    parts = stream.feed(text) + stream.finish(truncated)
    calls = [p.call for p in parts if isinstance(p, CallClosed)]
    content = "".join(p.text for p in parts if isinstance(p, Text))
    thought = "".join(p.text for p in parts if isinstance(p, Thought))
    return Answer(thought or None, (content.strip() if calls else content) or None, calls)
