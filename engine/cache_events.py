"""What the prefix cache tells a listener about its entries, so a router outside the process can know
which prefixes this replica holds (the server's KV-event publisher listens).

An entry is named by `prefix_keys.prefix_key(tokens)`: its token count and a digest of its tokens.
The calls come on the engine thread, inside a step, some under the cache's lock: a listener must
return at once (queue the change, never wait on a socket or another thread).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from ballast.engine.prefix_keys import PrefixKey


class CacheListener(Protocol):
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
