"""How the prefix cache and the parked sequences name what they hold, find the longest held prefix
of a prompt, and tell a listener about the cache's entries."""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Protocol

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


class CacheListener(Protocol):
    """What the prefix cache tells a listener (the server's KV-event publisher) about its entries.
    The calls come on the engine thread, some under the cache's lock: a listener must return at
    once (queue the change, never wait on a socket or another thread)."""

    def stored(self, key: PrefixKey, tokens: Sequence[int]) -> None:
        """A checkpoint of exactly `tokens` is held now (KV of every position, and on a hybrid
        model the recurrent state after the last token)."""
        ...

    def removed(self, key: PrefixKey) -> None:
        """The entry is gone (evicted to fit another, or for KV blocks a sequence needs)."""
        ...

    def cleared(self) -> None:
        """Every entry is gone (shed under memory pressure, or a checkpoint buffer failed)."""
        ...
