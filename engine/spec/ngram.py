"""Prompt lookup: the draft is what followed the latest earlier occurrence of the context's last
n tokens, for the longest n in [min_n, max_n] that occurs. No weights; a copy of the prompt (code
edits, quoting, summaries that reuse phrases) is drafted whole."""

from __future__ import annotations

from collections.abc import Sequence


def propose(context: Sequence[int], k: int, min_n: int, max_n: int) -> tuple[int, ...]:
    """Up to k tokens continuing `context` (prompt + output), or () when no suffix n-gram recurs."""
    size = len(context)
    if k <= 0 or size < min_n + 1:
        return ()
    tokens = list(context)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = tokens[size - n :]
        first = suffix[0]
        # Latest occurrence that ends before the suffix itself, scanning backwards.
        start = size - n - 1
        while start >= 0:
            try:
                start = _rindex(tokens, first, start)
            except ValueError:
                break
            if tokens[start : start + n] == suffix:
                return _continuation(tokens, start + n, k)
            start -= 1
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


def _rindex(tokens: list[int], value: int, end: int) -> int:
    """The last index <= end holding value (ValueError if none)."""
    for i in range(end, -1, -1):
        if tokens[i] == value:
            return i
    raise ValueError(value)
