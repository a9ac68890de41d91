"""How the prefix cache and the parked sequences name what they hold, and find the longest held
prefix of a prompt."""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter
from collections.abc import Mapping, Sequence

PrefixKey = tuple[int, bytes]


def prefix_key(tokens: Sequence[int]) -> PrefixKey:
    """The token count and a digest of the tokens."""
    return len(tokens), hashlib.blake2b(array("q", tokens).tobytes(), digest_size=16).digest()


def forget_length(lengths: Counter[int], n: int) -> None:
    """One entry of n tokens is gone: count it out (a length with no entry left is not kept)."""
    lengths[n] -= 1
    if not lengths[n]:
        del lengths[n]


def longest(lengths: Counter[int], entries: Mapping[PrefixKey, object], tokens: Sequence[int]) -> int:
    """The longest n < len(tokens) with an entry keyed by tokens[:n] (hashes of growing prefixes)."""
    candidates = sorted(n for n in lengths if n < len(tokens))
    h = hashlib.blake2b(digest_size=16)
    prev, best = 0, 0
    for n in candidates:
        h.update(array("q", tokens[prev:n]).tobytes())
        prev = n
        if (n, h.copy().digest()) in entries:
            best = n
    return best
