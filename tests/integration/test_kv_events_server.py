"""KV events from a real server: a ZMQ subscriber decodes the block events of an in-process server
(real engine, builtin:tiny-qwen3-next, a hybrid: each event announces a checkpoint) while
multi-turn chats run over HTTP, and the blocks it was told of are exactly the blocks of the entries
the prefix cache holds; a later turn reuses only blocks the subscriber knows; WATCH sheds the cache
and the subscriber sees it cleared. Plus `ballast serve`'s start-up refusals."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest
import zmq
from ballast.engine.config import EngineConfig, PrefixCacheConfig
from ballast.engine.engine import Engine
from ballast.engine.kv.prefix_keys import prefix_key
from ballast.memory.config import MemoryConfig
from ballast.memory.device import StaticDeviceReader
from ballast.memory.types import Level
from ballast.memory.watch import MemWatch
from ballast.scheduler.config import SchedulerConfig
from ballast.server.app import create_app
from ballast.server.cli import main
from ballast.server.config import ServerConfig
from ballast.server.kv_events import KVEventsConfig
from ballast.server.kv_publisher import KVEventPublisher
from memfixtures import level_tree
from serverproc import running_server, serve_subprocess

pytestmark = pytest.mark.slow

HYBRID = EngineConfig(
    model="builtin:tiny-qwen3-next", device="cpu", max_num_seqs=4, max_model_len=512, prefill_chunk_tokens=64
)
TOPIC = "kv@replica-0"


def own_chain(tokens: list[int], block_size: int) -> list[int]:
    """Block hashes as docs/OPERATIONS.md states them, computed here independently."""
    out: list[int] = []
    for i in range(0, len(tokens) // block_size * block_size, block_size):
        data = (out[-1] if out else 0).to_bytes(8, "big")
        data += b"".join(t.to_bytes(8, "little", signed=True) for t in tokens[i : i + block_size])
        out.append(int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big") >> 1)
    return out


class Subscriber:
    """A router's view of one replica: applies every event batch in sequence order (asking the
    replay socket for what it joined too late to see) and checks each event on the way."""

    def __init__(self, endpoint: str, replay: str) -> None:
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        self._sub.connect(endpoint)
        self._replay = replay
        self.next_seq = 0
        self.block_size = 0
        self.live: dict[int, int] = {}  # hash -> blocks before it and it (its depth)
        self.counts = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}
        self.problems: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sub.poll(50):
                continue
            topic, seq_bytes, payload = self._sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if topic != TOPIC.encode():
                self.problems.append(f"topic {topic!r}")
            if seq > self.next_seq:
                self._catch_up(seq)
            if seq == self.next_seq:
                self._apply(seq, payload)

    def _catch_up(self, upto: int) -> None:
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.connect(self._replay)
        dealer.send_multipart([b"", self.next_seq.to_bytes(8, "big")])
        while True:
            if not dealer.poll(5000):
                self.problems.append("replay did not answer")
                break
            _, seq_bytes, payload = dealer.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq == -1:
                break
            if seq == self.next_seq and seq < upto:
                self._apply(seq, payload)
        dealer.close(linger=0)
        if self.next_seq != upto:
            self.problems.append(f"replay left a gap before {upto} (at {self.next_seq})")

    def _apply(self, seq: int, payload: bytes) -> None:
        ts, events, rank = msgpack.unpackb(payload)
        if not isinstance(ts, float) or rank != 0:
            self.problems.append(f"batch {seq}: header {ts!r} {rank!r}")
        with self._lock:
            for e in events:
                self.counts[e["type"]] += 1
                if e["type"] == "BlockStored":
                    self._stored(e)
                elif e["type"] == "BlockRemoved":
                    for h in e["block_hashes"]:
                        if self.live.pop(h, None) is None:
                            self.problems.append(f"removed a block never stored: {h}")
                else:
                    self.live.clear()
            self.next_seq = seq + 1

    def _stored(self, e: dict[str, Any]) -> None:
        bs, parent, hashes = e["block_size"], e["parent_block_hash"], e["block_hashes"]
        if self.block_size not in (0, bs):
            self.problems.append(f"block size {bs} after {self.block_size}")
        self.block_size = bs
        if parent is not None and parent not in self.live:
            self.problems.append(f"parent {parent} not held")
            return
        depth = self.live[parent] if parent is not None else 0
        # The hash of each block is its parent's and its tokens', as documented.
        expected: list[int] = []
        prev = parent
        for i in range(len(hashes)):
            data = (prev or 0).to_bytes(8, "big")
            data += b"".join(
                t.to_bytes(8, "little", signed=True) for t in e["token_ids"][i * bs : (i + 1) * bs]
            )
            prev = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big") >> 1
            expected.append(prev)
        if expected != hashes or len(e["token_ids"]) != bs * len(hashes):
            self.problems.append(f"block hashes do not follow from the tokens: {e}")
        # A hybrid checkpoint lies at or after the blocks it announces, inside the next block.
        if not (depth + len(hashes)) * bs <= e["checkpoint_position"] < (depth + len(hashes) + 1) * bs:
            self.problems.append(f"checkpoint {e['checkpoint_position']} outside its last block: {e}")
        if e["medium"] != "CPU" or e["lora_id"] is not None:
            self.problems.append(f"fields: {e}")
        for i, h in enumerate(hashes):
            self.live[h] = depth + i + 1

    def blocks(self) -> set[int]:
        with self._lock:
            return set(self.live)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._sub.close(linger=0)
        self._ctx.term()


def wait_for(cond: Any, timeout_s: float = 30.0) -> bool:
    """Bounded wait for the engine and publisher threads to settle (no timing is asserted)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return bool(cond())


async def conversation(client: httpx.AsyncClient, k: int, turns: int) -> list[dict[str, str]]:
    messages: list[dict[str, str]] = []
    for t in range(turns):
        messages.append(
            {"role": "user", "content": f"conversation {k}, turn {t}: tell me about boat {k * 7 + t}"}
        )
        r = await client.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": messages, "max_tokens": 12, "temperature": 0},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
    return messages


async def chats(url: str, n: int, turns: int) -> list[list[dict[str, str]]]:
    async with httpx.AsyncClient(base_url=url) as client:
        return await asyncio.gather(*(conversation(client, k, turns) for k in range(n)))


def test_subscriber_sees_exactly_the_blocks_of_the_held_checkpoints(tmp_path: Path) -> None:
    root = tmp_path / "mem"
    root.mkdir()
    mem = MemoryConfig(root=str(root))
    level_tree(root, Level.OK, config=mem)
    watch = MemWatch(mem, StaticDeviceReader())
    cfg = KVEventsConfig(
        endpoint=f"ipc://{tmp_path}/events", replay_endpoint=f"ipc://{tmp_path}/replay", topic=TOPIC
    )
    publisher = KVEventPublisher(cfg)
    engines: list[Engine] = []

    def factory() -> Engine:
        # Room for a few of this model's checkpoints (~17 KiB of state + 16 KiB per 32-token block):
        # the four chats' entries evict each other, so blocks no entry covers any more are removed.
        cache = PrefixCacheConfig(checkpoint_interval=32, max_bytes=300_000)
        engine = Engine.load(HYBRID, watch, prefix_cache=cache)
        publisher.attach(engine)
        engines.append(engine)
        return engine

    app = create_app(
        ServerConfig(served_model_name="m"),
        SchedulerConfig(),
        factory,
        memwatch=watch,
        collectors=(publisher.collector(),),
    )
    sub = Subscriber(cfg.endpoint or "", cfg.replay_endpoint or "")
    try:
        with running_server(app) as url:
            conversations = asyncio.run(chats(url, 4, 3))
            cache = engines[0].prefix_cache
            assert cache is not None
            bs = sub.block_size
            assert bs == 32  # the KV pool's block size

            def held_blocks() -> set[int]:
                held = publisher.changes.held()
                if {prefix_key(t) for t in held.values()} != cache.entry_keys():
                    return {-1}  # a step still running
                return {h for t in held.values() for h in own_chain(list(t), bs)}

            assert wait_for(lambda: sub.blocks() == held_blocks() and sub.blocks())
            assert sub.problems == []
            assert sub.counts["BlockStored"] > 0 and sub.counts["BlockRemoved"] > 0  # the budget evicted

            # The next turn of each chat: every block its restored prefix spans was announced.
            def leading_known(prompt: list[int]) -> int:
                known, n = sub.blocks(), 0
                for h in own_chain(prompt, bs):
                    if h not in known:
                        break
                    n += 1
                return n

            nexts = [[*m, {"role": "user", "content": "and then?"}] for m in conversations]
            prompts = [httpx.post(url + "/tokenize", json={"messages": m}).json()["tokens"] for m in nexts]
            # The chats whose prefix is still held go first (a turn's saves evict other chats').
            order = sorted(range(len(nexts)), key=lambda i: -leading_known(prompts[i]))
            reused, announced = 0, 0
            for i in order:
                leading = leading_known(prompts[i])
                r = httpx.post(
                    url + "/v1/chat/completions",
                    json={"model": "m", "messages": nexts[i], "max_tokens": 2, "temperature": 0},
                    timeout=120,
                ).json()
                cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert cached // bs <= leading, (cached, leading)
                reused += cached
                announced += leading
            assert announced > 0 and reused > 0

            metrics = httpx.get(url + "/metrics").text
            assert (
                f'ballast_kv_events_total{{type="BlockStored"}} {float(sub.counts["BlockStored"])}' in metrics
            )
            assert "ballast_kv_events_dropped_total 0.0" in metrics

            # WATCH: the ladder sheds the cache, the subscriber is told it is cleared.
            level_tree(root, Level.WATCH, config=mem)
            assert watch.poll_now().level is Level.WATCH
            asyncio.run(chats(url, 1, 1))
            assert wait_for(lambda: sub.counts["AllBlocksCleared"] >= 1 and not sub.blocks())
            assert cache.entry_keys() == frozenset() and sub.problems == []
    finally:
        sub.close()
        publisher.stop()


def test_serve_refuses_bad_kv_event_settings_at_start_up(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = ["serve", "--model", "builtin:tiny-llama"]
    cases = [
        ([*model, "--kv-events-endpoint", "udp://*:1"], "is not a ZMQ endpoint"),
        ([*model, "--kv-events-replay-endpoint", f"ipc://{tmp_path}/r"], "needs --kv-events-endpoint"),
        (
            [*model, "--kv-events-endpoint", f"ipc://{tmp_path}/e", "--prefix-cache-fraction", "0"],
            "needs --prefix-cache-fraction",
        ),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            main(argv, {})
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


def test_ballast_serve_publishes_when_given_an_endpoint(tmp_path: Path) -> None:
    """The CLI path: `ballast serve --kv-events-endpoint ... --kv-events-replay-endpoint ...` in a
    child process; after a completion, the replay socket hands back the batches from sequence 0,
    which store the prompt's blocks; /metrics counts them."""
    events, replay = f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"
    args = ["--model", "builtin:tiny-llama", "--max-model-len", "256", "--max-num-seqs", "2"]
    args += [
        "--kv-events-endpoint",
        events,
        "--kv-events-replay-endpoint",
        replay,
        "--kv-events-format",
        "array",
    ]
    # The host as the server reads it is a tree at OK: on a shared box the real one may sit at
    # WATCH, where the ladder sheds the prefix cache and nothing is stored to publish.
    root = tmp_path / "host"
    level_tree(root, Level.OK)
    with serve_subprocess(args, {"BALLAST_MEMORY_ROOT": str(root)}) as (url, _):
        body = {"model": "builtin:tiny-llama", "prompt": list(range(5, 105)), "max_tokens": 2}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(replay)
        stored: list[list[Any]] = []
        try:
            stored_metric = 'ballast_kv_events_total{type="BlockStored"}'
            assert wait_for(lambda: metric_value(url, stored_metric) >= 1), [
                line
                for line in httpx.get(url + "/metrics").text.splitlines()
                if line.startswith(("ballast_ladder", "ballast_memory", "ballast_prefix", "ballast_kv_"))
            ]
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            while True:
                assert dealer.poll(5000)
                _, seq, payload = dealer.recv_multipart()
                if int.from_bytes(seq, "big", signed=True) == -1:
                    break
                stored += [e for e in msgpack.unpackb(payload)[1] if e[0] == "BlockStored"]
        finally:
            dealer.close(linger=0)
            ctx.term()
    first = stored[0]
    block_size = first[4]
    assert first[2] is None and first[3] == list(range(5, 5 + len(first[1]) * block_size))
    assert first[1] == own_chain(list(range(5, 105)), block_size)[: len(first[1])]


def metric_value(url: str, series: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0
