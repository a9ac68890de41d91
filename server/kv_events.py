"""KV events for precise prefix routing: the prefix cache's entries as vLLM's block stored / block
removed / all blocks cleared events, so a router can know which replica holds a prompt's prefix.

What an event means here. ballast resumes a prompt from a *checkpoint*: an entry of the prefix cache
that holds the KV of positions [0, n) and, on a hybrid model, the recurrent state after exactly n
tokens (a recurrent state cannot be truncated, so a later prompt can start only at an n some entry
was saved at; an attention-only model's entries are reused the same way). Each entry saved
announces the full KV blocks of its tokens that no other entry already announced, in one
`BlockStored` whose `checkpoint_position` is n; a block is removed (`BlockRemoved`) when the last
entry covering it goes; a shed empties the cache (`AllBlocksCleared`). A router that matches a
prompt's leading blocks learns what this replica holds; the reuse it gets is up to the longest
checkpoint position at or below the matched length (`checkpoint_position` of the stored events).

The wire format is vLLM's: a ZMQ multipart message (topic, 8-byte big-endian sequence number,
payload), the payload a msgpack array `[ts, events, data_parallel_rank]`. Each event is a msgpack
map with its kind under "type" (vLLM since its events became maps), or with `--kv-events-format
array` the positional array older subscribers decode (`["BlockStored", block_hashes,
parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]`, without
`checkpoint_position`). A block's hash is 63 bits, chained so a subscriber can recompute it from
the tokens: `blake2b(parent as 8 bytes big-endian (0 for the first block) + the block's token ids
as int64 little-endian, digest_size=8)` read big-endian, shifted right by one.
"""

from __future__ import annotations

import hashlib
import re
import sys
from array import array
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ballast.engine.kv.prefix_keys import PrefixKey

from ballast.settings import ConfigError, check, setting

# Where the PUB socket binds (a wildcard host, ipc, inproc) or connects (a named host), as vLLM does.
_ENDPOINT_RE = re.compile(r"(tcp://(\*|[A-Za-z0-9.\-]+|\[[0-9A-Fa-f:.]+\]):(\d{1,5})|(ipc|inproc)://\S+)")


@dataclass(frozen=True)
class KVEventsConfig:
    """The KV-event publisher's settings (off unless an endpoint is given)."""

    endpoint: str | None = field(
        default=None,
        metadata=setting(
            "BALLAST_KV_EVENTS_ENDPOINT",
            "publish the prefix cache's block stored/removed/cleared events (vLLM's ZMQ format) on "
            "this ZMQ PUB endpoint: tcp://*:PORT binds, tcp://HOST:PORT connects, ipc:// binds; "
            "unset = no events",
        ),
    )
    replay_endpoint: str | None = field(
        default=None,
        metadata=setting(
            "BALLAST_KV_EVENTS_REPLAY_ENDPOINT",
            "ZMQ ROUTER endpoint (bound) where a subscriber that missed batches asks for them again "
            "from a sequence number (8 bytes big-endian); needs the events endpoint",
        ),
    )
    topic: str | None = field(
        default=None,
        metadata=setting("BALLAST_KV_EVENTS_TOPIC", "topic of every event message (unset = empty)"),
    )
    format: str = field(
        default="map",
        metadata=setting(
            "BALLAST_KV_EVENTS_FORMAT",
            "each event as a map with its kind under 'type' (vLLM today), or the positional array "
            "older subscribers decode",
            choices=("map", "array"),
        ),
    )
    queue: int = field(
        default=10_000,
        metadata=setting(
            "BALLAST_KV_EVENTS_QUEUE",
            "cache changes waiting for the publisher thread; past it changes are dropped (counted) "
            "and the cache is announced again whole (a cleared event, then every entry)",
            1,
            1 << 20,
        ),
    )

    def __post_init__(self) -> None:
        check(self)
        for name, env, value in (
            ("--kv-events-endpoint", "BALLAST_KV_EVENTS_ENDPOINT", self.endpoint),
            ("--kv-events-replay-endpoint", "BALLAST_KV_EVENTS_REPLAY_ENDPOINT", self.replay_endpoint),
        ):
            if value is not None and not valid_endpoint(value):
                raise ConfigError(
                    f"{name} ({env})={value!r} is not a ZMQ endpoint: accepted tcp://*:PORT, "
                    "tcp://HOST:PORT (port 1..65535), ipc://PATH or inproc://NAME"
                )
        if self.replay_endpoint is not None:
            if self.endpoint is None:
                raise ConfigError(
                    "--kv-events-replay-endpoint (BALLAST_KV_EVENTS_REPLAY_ENDPOINT) needs "
                    "--kv-events-endpoint (BALLAST_KV_EVENTS_ENDPOINT)"
                )
            if self.replay_endpoint == self.endpoint:
                raise ConfigError(
                    "--kv-events-replay-endpoint (BALLAST_KV_EVENTS_REPLAY_ENDPOINT) must differ from "
                    "--kv-events-endpoint (BALLAST_KV_EVENTS_ENDPOINT)"
                )

    @property
    def enabled(self) -> bool:
        return self.endpoint is not None


def valid_endpoint(endpoint: str) -> bool:
    m = _ENDPOINT_RE.fullmatch(endpoint)
    return m is not None and (m.group(3) is None or 1 <= int(m.group(3)) <= 65535)


def binds(endpoint: str) -> bool:
    """The PUB socket binds a wildcard host, ipc and inproc, and connects to a named host."""
    return "*" in endpoint or "::" in endpoint or not endpoint.startswith("tcp://")


def block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """A full block's hash, chained on its parent's (see the module doc)."""
    ids = array("q", tokens)
    if sys.byteorder == "big":
        ids.byteswap()
    head = (parent or 0).to_bytes(8, "big")
    return int.from_bytes(hashlib.blake2b(head + ids.tobytes(), digest_size=8).digest(), "big") >> 1


def block_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """The chained hashes of the full blocks of `tokens` (a partly filled last block has none)."""
    out: list[int] = []
    parent: int | None = None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tokens[start : start + block_size])
        out.append(parent)
    return out


Event = dict[str, Any] | list[Any]


class BlockIndex:
    """Which blocks the subscribers were told of, and how many entries cover each: turns the cache's
    entry changes into block events. The blocks announced are every entry's blocks together, which
    is closed under prefixes (a block's hash names its whole prefix), so the blocks an entry adds
    or takes away are always the tail of its chain."""

    def __init__(self, block_size: int, medium: str, fmt: str) -> None:
        self.block_size = block_size
        self._medium = medium
        self._map = fmt == "map"
        self._chains: dict[PrefixKey, list[int]] = {}
        self._covers: Counter[int] = Counter()

    @property
    def blocks(self) -> frozenset[int]:
        """The hashes announced and not removed since."""
        return frozenset(self._covers)

    def stored(self, key: PrefixKey, tokens: Sequence[int]) -> list[Event]:
        if key in self._chains:
            return []
        chain = block_hashes(tokens, self.block_size)
        self._chains[key] = chain
        first = next((i for i, h in enumerate(chain) if h not in self._covers), len(chain))
        self._covers.update(chain)
        if first == len(chain):
            return []
        parent = chain[first - 1] if first else None
        new_tokens = list(tokens[first * self.block_size : len(chain) * self.block_size])
        return [self._block_stored(chain[first:], parent, new_tokens, len(tokens))]

    def removed(self, key: PrefixKey) -> list[Event]:
        chain = self._chains.pop(key, None)
        if chain is None:  # its store was dropped and the re-announce came after its removal
            return []
        gone = []
        for h in chain:
            self._covers[h] -= 1
            if not self._covers[h]:
                del self._covers[h]
                gone.append(h)
        if not gone:
            return []
        return [
            {"type": "BlockRemoved", "block_hashes": gone, "medium": self._medium}
            if self._map
            else ["BlockRemoved", gone, self._medium]
        ]

    def cleared(self) -> list[Event]:
        self._chains.clear()
        self._covers.clear()
        return [{"type": "AllBlocksCleared"} if self._map else ["AllBlocksCleared"]]

    def announce_again(self, live: dict[PrefixKey, Sequence[int]]) -> list[Event]:
        """After dropped changes: clear, then every entry the cache holds."""
        events = self.cleared()
        for key, tokens in live.items():
            events += self.stored(key, tokens)
        return events

    def _block_stored(self, hashes: list[int], parent: int | None, tokens: list[int], at: int) -> Event:
        if not self._map:
            return ["BlockStored", hashes, parent, tokens, self.block_size, None, self._medium, None]
        return {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": parent,
            "token_ids": tokens,
            "block_size": self.block_size,
            "lora_id": None,
            "medium": self._medium,
            "lora_name": None,
            "checkpoint_position": at,
        }
