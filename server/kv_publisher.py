"""The KV-event publisher: the prefix cache's changes, published off the engine thread.

The engine thread only queues each change (`ChangeQueue`, the cache's listener): a bounded queue
and a dict write, never a socket. A publisher thread turns changes into vLLM's block events
(`kv_events.BlockIndex`), one batch per wake-up, and sends them on a ZMQ PUB socket; with a replay
endpoint it also answers ROUTER requests for batches a subscriber missed. A full queue drops the
change (counted on /metrics) and, as soon as a change fits again, queues the cache's whole state
instead: the subscribers get a cleared event and every entry again, so they converge whatever was
lost. Needs pyzmq and msgpack (`pip install 'ballast[kv-events]'`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from array import array
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, NamedTuple

import msgpack
import zmq
from ballast.engine.kv.prefix_keys import PrefixKey
from ballast.server.kv_events import BlockIndex, Event, KVEventsConfig, binds
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from ballast.settings import ConfigError

if TYPE_CHECKING:  # the engine pulls in torch; the publisher only reads it
    from ballast.engine.engine import Engine

log = logging.getLogger(__name__)

# How long the publisher thread waits for a change before it looks at replay requests again.
POLL_S = 0.05
# Changes folded into one batch at most (a burst of saves becomes a few messages, not thousands).
BATCH_CHANGES = 512
# Batches kept for replay requests (as vLLM keeps by default).
REPLAY_BATCHES = 10_000
# The sequence number that ends a replay answer.
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
# Positions per block announced for a model with no KV pool (recurrent layers only).
NO_POOL_BLOCK_SIZE = 16


class Change(NamedTuple):
    kind: str  # stored, removed, cleared, or again (the whole cache, after dropped changes)
    key: PrefixKey | None = None
    tokens: array[int] | None = None
    live: dict[PrefixKey, array[int]] | None = None


class ChangeQueue:
    """The prefix cache's listener, on the engine thread: records each change and queues it
    without waiting. It keeps every held entry's tokens (8 bytes a token, next to the KV the entry
    holds) so the whole cache can be announced again after a drop."""

    def __init__(self, size: int) -> None:
        self._queue: queue.Queue[Change] = queue.Queue(maxsize=size)
        self._live: dict[PrefixKey, array[int]] = {}
        self._lost = False
        self.dropped = 0

    def stored(self, key: PrefixKey, tokens: Sequence[int]) -> None:
        held = array("q", tokens)
        self._live[key] = held
        self._offer(Change("stored", key, held))

    def removed(self, key: PrefixKey) -> None:
        self._live.pop(key, None)
        self._offer(Change("removed", key))

    def cleared(self) -> None:
        self._live.clear()
        self._offer(Change("cleared"))

    def held(self) -> dict[PrefixKey, array[int]]:
        """The entries the cache holds, as told (read it while no step runs)."""
        return dict(self._live)

    def take(self, timeout: float) -> list[Change]:
        """The next changes, oldest first (empty after `timeout` seconds without one)."""
        try:
            out = [self._queue.get(timeout=timeout)]
        except queue.Empty:
            return []
        while len(out) < BATCH_CHANGES:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return out

    def _offer(self, change: Change) -> None:
        if self._lost:  # what was dropped is folded into the whole state, which includes this change
            change = Change("again", live=dict(self._live))
        try:
            self._queue.put_nowait(change)
        except queue.Full:
            self.dropped += 1
            self._lost = True
            return
        self._lost = False


class KVEventPublisher:
    """Binds (or connects) its sockets when built, so a bad or busy endpoint stops start-up; starts
    publishing once `attach` hands it the engine's prefix cache."""

    def __init__(self, cfg: KVEventsConfig) -> None:
        assert cfg.endpoint is not None
        self._cfg = cfg
        self._topic = (cfg.topic or "").encode()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            if binds(cfg.endpoint):
                self._pub.bind(cfg.endpoint)
            else:
                self._pub.connect(cfg.endpoint)
            if cfg.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(cfg.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ConfigError(
                f"--kv-events-endpoint / --kv-events-replay-endpoint: cannot open "
                f"{cfg.endpoint} / {cfg.replay_endpoint}: {exc}"
            ) from exc
        self.changes = ChangeQueue(cfg.queue)
        self._sent: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_BATCHES if self._replay else 0)
        self._seq = 0
        self._published: Counter[str] = Counter()
        self._index: BlockIndex | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ballast-kv-events", daemon=True)

    def attach(self, engine: Engine) -> None:
        """Listen to the engine's prefix cache (on, or start-up refused the setting) and start
        publishing. Called after the load, before any step."""
        cache = engine.prefix_cache
        if cache is None:
            raise ConfigError("--kv-events-endpoint needs the prefix cache (--prefix-cache-fraction > 0)")
        figures = engine.kv_figures()
        self.start(
            figures.block_size if figures is not None else NO_POOL_BLOCK_SIZE,
            "GPU" if engine.device.type == "cuda" else "CPU",
        )
        cache.listener = self.changes

    def start(self, block_size: int, medium: str) -> None:
        """Publish what `changes` receives, as blocks of `block_size` positions kept in `medium`."""
        self._index = BlockIndex(block_size, medium, self._cfg.format)
        self._thread.start()
        log.info(
            "KV events on %s (block size %d, %s events)", self._cfg.endpoint, block_size, self._cfg.format
        )

    @property
    def blocks(self) -> frozenset[int]:
        """The block hashes announced and not removed (what a subscriber that missed nothing holds);
        read it while no change is being published (the publisher thread updates it)."""
        return self._index.blocks if self._index is not None else frozenset()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._close_sockets()

    def published(self, kind: str) -> int:
        """Events of this type (BlockStored, BlockRemoved, AllBlocksCleared) sent so far."""
        return self._published[kind]

    def collector(self) -> Collector:
        return _PublisherCollector(self)

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self._once()
            except Exception:  # a bad replay request or batch must not end the publishing
                log.exception("KV events: publisher step failed")

    def _once(self) -> None:
        assert self._index is not None
        index = self._index
        if self._replay is not None and self._replay.poll(0):
            self._answer_replay(self._replay)
        events: list[Event] = []
        for c in self.changes.take(POLL_S):
            if c.kind == "stored":
                assert c.key is not None and c.tokens is not None
                events += index.stored(c.key, c.tokens)
            elif c.kind == "removed":
                assert c.key is not None
                events += index.removed(c.key)
            elif c.kind == "cleared":
                events += index.cleared()
            else:
                assert c.live is not None
                events += index.announce_again(dict(c.live))
        if events:
            self._send(events)

    def _send(self, events: list[Event]) -> None:
        payload = msgpack.packb([time.time(), events, 0])
        try:
            self._pub.send_multipart([self._topic, self._seq.to_bytes(8, "big"), payload])
        except zmq.ZMQError:
            log.exception("KV events: batch %d not sent", self._seq)
        self._sent.append((self._seq, payload))
        self._seq += 1
        self._published.update(e["type"] if isinstance(e, dict) else e[0] for e in events)

    def _answer_replay(self, router: zmq.Socket[bytes]) -> None:
        """A subscriber asks for every kept batch from a sequence number on: [id, b"", seq]."""
        frames = router.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV events: a replay request of %d frames ignored", len(frames))
            return
        client, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in self._sent:
            if seq >= start:
                router.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
        router.send_multipart([client, b"", END_OF_REPLAY, b""])

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()


class _PublisherCollector(Collector):
    def __init__(self, publisher: KVEventPublisher) -> None:
        self._p = publisher

    def collect(self) -> Iterator[Metric]:
        events = CounterMetricFamily("ballast_kv_events", "KV events published, by type", labels=["type"])
        for kind in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
            events.add_metric([kind], self._p.published(kind))
        yield events
        yield CounterMetricFamily(
            "ballast_kv_events_dropped",
            "Prefix-cache changes dropped because the publisher's queue was full (the whole cache is "
            "announced again after)",
            value=self._p.changes.dropped,
        )
