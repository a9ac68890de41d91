"""The pieces an answer is read into, whatever API it goes out through: thinking, text, and tool
calls whose arguments arrive as they are generated. `ballast.server.answer` produces them from
the model's text; chat chunks, Anthropic Messages events and Responses events are written from
them, so the three APIs read an answer one way."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Call:
    id: str
    name: str
    arguments: str  # JSON text of an object (a truncated call's may be cut short)


@dataclass(frozen=True)
class Thought:
    """Reasoning text (between `<think>` and `</think>`)."""

    text: str


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class CallOpened:
    index: int  # the call's place among this answer's calls
    id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    text: str  # the next piece of the arguments' JSON text


@dataclass(frozen=True)
class CallClosed:
    index: int
    call: Call  # its arguments are the concatenation of the call's CallArguments pieces


Part = Thought | Text | CallOpened | CallArguments | CallClosed
