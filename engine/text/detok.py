"""Incremental detokenization: token ids in, exact text deltas out.

A character can span tokens and a token's leading space depends on what precedes it, so (as vLLM
and TGI do) a small window is decoded twice, up to `read_offset` and up to the newest token, and
the delta is the difference; a tail that decodes to U+FFFD waits for the next token. Text that
could still become a stop string is held back too; the first full match cuts.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Protocol

REPLACEMENT = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded with the first outputs, for spacing context


class Decoder(Protocol):
    def decode(self, token_ids: Sequence[int]) -> str: ...


class Detokenizer:
    """Implements `ballast.engine.interface.DetokenizerLike` over any tokenizer's `decode`."""

    def __init__(self, decoder: Decoder, prompt_ids: Sequence[int], stop: Sequence[str] = ()) -> None:
        self._decoder = decoder
        self._tokens = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        stops = tuple(s for s in stop if s)
        # One pass for a match (the leftmost of every stop, by one regular expression) and one
        # set lookup per tail length for a match that may still complete.
        self._stop_re = re.compile("|".join(map(re.escape, stops))) if stops else None
        self._prefixes = {s[:n] for s in stops for n in range(1, len(s))}
        self._longest_prefix = max((len(s) - 1 for s in stops), default=0)
        self._held = ""  # decoded text not yet emitted because it may start a stop string
        self.stopped = False
        self.text = ""  # everything emitted so far

    def add(self, token_id: int) -> str:
        if self.stopped:
            return ""
        self._tokens.append(token_id)
        return self._emit(self._next_text(final=False), final=False)

    def flush(self) -> str:
        if self.stopped:
            return ""
        return self._emit(self._next_text(final=True), final=True)

    def _next_text(self, final: bool) -> str:
        """New complete text since the last call (with `final`, also an incomplete tail)."""
        window = self._tokens[self._prefix_offset :]
        prefix = self._decoder.decode(self._tokens[self._prefix_offset : self._read_offset])
        full = self._decoder.decode(window)
        if len(full) <= len(prefix) or (full.endswith(REPLACEMENT) and not final):
            return ""
        # Tokens up to here decode to complete text; later windows start where this one ended.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        return full[len(prefix) :]

    def _emit(self, new_text: str, final: bool) -> str:
        text = self._held + new_text
        cut = self._first_stop(text)
        if cut is not None:
            self.stopped = True
            self._held = ""
            out = text[:cut]
        else:
            keep = 0 if final else self._stop_prefix_len(text)
            out = text[: len(text) - keep]
            self._held = text[len(text) - keep :]
        self.text += out
        return out

    def _first_stop(self, text: str) -> int | None:
        match = self._stop_re.search(text) if self._stop_re is not None else None
        return match.start() if match is not None else None

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        for n in range(min(self._longest_prefix, len(text)), 0, -1):
            if text[-n:] in self._prefixes:
                return n
        return 0
