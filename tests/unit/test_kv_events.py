"""KV events: the block index that turns prefix-cache entries into vLLM's block events, the
publisher's settings, and the publisher itself over a real ZMQ socket (PUB/SUB and the replay
ROUTER), including what a full queue does."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from ballast.engine.kv.prefix_keys import prefix_key
from ballast.server.kv_events import BlockIndex, KVEventsConfig
from ballast.server.kv_publisher import ChangeQueue, KVEventPublisher

from ballast.settings import ConfigError

BS = 4


def own_hash(parent: int | None, tokens: list[int]) -> int:
    """The hash as the module doc states it, written out again here."""
    data = (parent or 0).to_bytes(8, "big") + b"".join(t.to_bytes(8, "little", signed=True) for t in tokens)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big") >> 1


def chain(tokens: list[int]) -> list[int]:
    out: list[int] = []
    for i in range(0, len(tokens) // BS * BS, BS):
        out.append(own_hash(out[-1] if out else None, tokens[i : i + BS]))
    return out


def test_entries_announce_only_their_new_tail_and_remove_what_no_entry_covers() -> None:
    index = BlockIndex(BS, "CPU", "map")
    short = list(range(10))  # 2 full blocks + 2 tokens
    long = short + list(range(100, 107))  # 4 full blocks + 1 token
    [first] = index.stored(prefix_key(short), short)
    assert first == {
        "type": "BlockStored",
        "block_hashes": chain(short),
        "parent_block_hash": None,
        "token_ids": short[:8],
        "block_size": BS,
        "lora_id": None,
        "medium": "CPU",
        "lora_name": None,
        "checkpoint_position": 10,
    }
    [second] = index.stored(prefix_key(long), long)
    assert second["block_hashes"] == chain(long)[2:] and second["parent_block_hash"] == chain(long)[1]
    assert second["token_ids"] == long[8:16] and second["checkpoint_position"] == len(long)
    assert index.stored(prefix_key(long), long) == []  # the same entry twice: nothing new
    assert index.stored(prefix_key(short[:9]), short[:9]) == []  # a checkpoint inside held blocks
    assert index.blocks == frozenset(chain(long))
    assert index.removed(prefix_key(short)) == []  # its blocks are still the long entry's
    assert index.removed(prefix_key(short[:9])) == []
    [gone] = index.removed(prefix_key(long))
    assert gone == {"type": "BlockRemoved", "block_hashes": chain(long), "medium": "CPU"}
    assert index.blocks == frozenset() and index.removed(prefix_key(long)) == []
    assert index.stored(prefix_key([1, 2]), [1, 2]) == []  # shorter than a block: nothing to route on


def test_array_format_is_positional_and_a_clear_forgets_everything() -> None:
    index = BlockIndex(BS, "GPU", "array")
    tokens = list(range(8))
    assert index.stored(prefix_key(tokens), tokens) == [
        ["BlockStored", chain(tokens), None, tokens, BS, None, "GPU", None]
    ]
    assert index.cleared() == [["AllBlocksCleared"]] and index.blocks == frozenset()
    assert index.removed(prefix_key(tokens)) == []
    again = index.announce_again({prefix_key(tokens): tokens})
    assert again == [
        ["AllBlocksCleared"],
        ["BlockStored", chain(tokens), None, tokens, BS, None, "GPU", None],
    ]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"endpoint": "tcp://*:0"},
        {"endpoint": "tcp://*:65536"},
        {"endpoint": "udp://*:5557"},
        {"endpoint": "tcp://host"},
        {"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5557"},
        {"replay_endpoint": "tcp://*:5558"},
        {"endpoint": "tcp://*:5557", "format": "json"},
        {"endpoint": "tcp://*:5557", "queue": 0},
    ],
)
def test_bad_settings_are_refused_naming_the_flag(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="--kv-events"):
        KVEventsConfig(**kwargs)


def test_good_endpoints() -> None:
    for ep in ("tcp://*:5557", "tcp://10.0.0.2:5557", "tcp://[::1]:5557", "ipc:///tmp/kv", "inproc://kv"):
        assert KVEventsConfig(endpoint=ep).enabled
    assert not KVEventsConfig().enabled


def test_a_full_queue_drops_changes_then_queues_the_whole_cache() -> None:
    q = ChangeQueue(size=2)
    entries = [list(range(n)) for n in (4, 8, 12, 16)]
    for tokens in entries:
        q.stored(prefix_key(tokens), tokens)
    assert q.dropped == 2
    q.removed(prefix_key(entries[0]))  # still full: dropped too
    assert q.dropped == 3
    assert [c.kind for c in q.take(0.1)] == ["stored", "stored"]
    q.removed(prefix_key(entries[1]))  # room again: the whole state goes instead of this change
    [again] = q.take(0.1)
    assert again.kind == "again" and again.live is not None
    assert sorted(again.live) == sorted(prefix_key(t) for t in entries[2:])
    q.cleared()
    assert [c.kind for c in q.take(0.1)] == ["cleared"] and q.held() == {}


def receive(sub: zmq.Socket[bytes], timeout_ms: int = 5000) -> tuple[bytes, int, list[Any]]:
    assert sub.poll(timeout_ms), "no event batch arrived"
    topic, seq, payload = sub.recv_multipart()
    return topic, int.from_bytes(seq, "big"), msgpack.unpackb(payload)


def test_publisher_sends_numbered_batches_and_replays_them(tmp_path: Path) -> None:
    cfg = KVEventsConfig(
        endpoint=f"ipc://{tmp_path}/ev", replay_endpoint=f"ipc://{tmp_path}/replay", topic="kv"
    )
    pub = KVEventPublisher(cfg)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(cfg.endpoint or "")
    try:
        pub.start(BS, "CPU")
        tokens = list(range(12))
        # A PUB drops what it sends before the subscription reaches it: store until one arrives.
        deadline = time.monotonic() + 10
        while not sub.poll(50):
            assert time.monotonic() < deadline
            pub.changes.cleared()
        topic, seq, batch = receive(sub)
        assert topic == b"kv" and batch[1] == [{"type": "AllBlocksCleared"}] and batch[2] == 0
        pub.changes.stored(prefix_key(tokens), tokens)
        while True:
            _, seq, batch = receive(sub)
            if batch[1][0]["type"] == "BlockStored":
                break
        [stored] = batch[1]
        assert stored["block_hashes"] == chain(tokens) and isinstance(batch[0], float)
        assert pub.blocks == frozenset(chain(tokens))
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(cfg.replay_endpoint or "")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = []
        while True:
            assert dealer.poll(5000)
            _, seq_bytes, payload = dealer.recv_multipart()
            if int.from_bytes(seq_bytes, "big", signed=True) == -1:
                assert payload == b""
                break
            replayed.append(int.from_bytes(seq_bytes, "big"))
        assert replayed == list(range(seq + 1))  # every batch from 0, in order
        dealer.close(linger=0)
        text = {m.name: m for m in pub.collector().collect()}
        assert {s.labels.get("type"): s.value for s in text["ballast_kv_events"].samples}["BlockStored"] == 1
    finally:
        sub.close(linger=0)
        ctx.term()
        pub.stop()


def test_a_busy_endpoint_is_a_start_up_error(tmp_path: Path) -> None:
    ctx = zmq.Context()
    holder = ctx.socket(zmq.ROUTER)
    port = holder.bind_to_random_port("tcp://127.0.0.1")
    try:
        cfg = KVEventsConfig(endpoint=f"ipc://{tmp_path}/ev", replay_endpoint=f"tcp://127.0.0.1:{port}")
        with pytest.raises(ConfigError, match="cannot open"):
            KVEventPublisher(cfg)
    finally:
        holder.close(linger=0)
        ctx.term()
