"""Prompt lookup: the draft is what followed the latest earlier occurrence of the context's last
n tokens, for the longest n in [min_n, max_n] that occurs. No weights; a copy of the prompt (code
edits, quoting, summaries that reuse phrases) is drafted whole."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

WORD = array("i").itemsize  # bytes per token id: a match is a byte match at a word boundary


def propose(context: Sequence[int], k: int, min_n: int, max_n: int) -> tuple[int, ...]:
    """Up to k tokens continuing `context` (prompt + output), or () when no suffix n-gram recurs.
    (Searched as bytes, in C: every decoding sequence gets a proposal checked after each step.)"""
    size = len(context)
    if k <= 0 or size < min_n + 1:
        return ()
    buf = array("i", context).tobytes()
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = buf[WORD * (size - n) :]
        # Latest occurrence that starts before the suffix itself (it may overlap it).
        at = buf.rfind(suffix, 0, WORD * (size - 1))
        while at > 0 and at % WORD:
            at = buf.rfind(suffix, 0, at + len(suffix) - 1)
        if at >= 0:
            return _continuation(list(context), at // WORD + n, k)
    return ()


def _continuation(tokens: list[int], source: int, k: int) -> tuple[int, ...]:
    """k tokens copied from `source` on; a copy that reaches the context's end goes on copying
    what it has just drafted (a repeating span of p tokens drafts k, not p)."""
    size = len(tokens)
    out: list[int] = []
    for j in range(k):
        at = source + j
        out.append(tokens[at] if at < size else out[at - size])
    return tuple(out)
