"""Three real replicas (the default model, CPU) behind the real gateway, `smg` (SGLang's Shepherd
Model Gateway, from PyPI), started once for the module: prefix affinity over multi-turn chats, a
replica forced to CRITICAL (its own temp /proc tree) leaving and rejoining the rotation with no
client seeing its 503s, and a replica killed mid-load. The kill runs last: it ends the fleet."""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from ballast.bench.fleet import PROBE_INTERVAL_S, Fleet, FleetError, smg_binary, wait_until
from ballast.memory.config import MemoryConfig
from ballast.memory.types import Level
from memfixtures import level_tree

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # timed: run alone (see pyproject's markers)

REPLICAS = 3
ARGS = ["--model", "default", "--served-model-name", "default", "--max-num-seqs", "8"]
ARGS += ["--max-model-len", "1024", "--memwatch-poll-s", "0.05"]


@dataclass
class Setup:
    fleet: Fleet
    gateway: str
    roots: list[Path]

    def client(self) -> openai.OpenAI:
        # No client retries: every refusal the gateway lets through would show as an error here.
        return openai.OpenAI(base_url=self.gateway + "/v1", api_key="none", max_retries=0, timeout=300)

    def set_level(self, i: int, level: Level) -> None:
        level_tree(self.roots[i], level, config=MemoryConfig(root=str(self.roots[i])))


# As deploy/'s smg files run it: with smg's default threshold (0.3) a second turn whose shared
# opening is a small share of its text is often routed by load instead (bench/gateway_multiturn:
# 73% of later turns found their prefix at 0.3, 100% at 0.1), which made this test flaky.
CACHE_AWARE = ("--cache-threshold", "0.1")
WORDS = (
    "river",
    "stone",
    "cloud",
    "garden",
    "window",
    "silver",
    "morning",
    "bread",
    "candle",
    "forest",
    "ocean",
    "letter",
    "music",
    "summer",
)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    try:
        smg_binary()
    except FleetError as exc:
        pytest.skip(str(exc))
    roots = [tmp_path_factory.mktemp(f"replica{i}") for i in range(REPLICAS)]
    for root in roots:
        level_tree(root, Level.OK, config=MemoryConfig(root=str(root)))
    per = [["--memory-root", str(root)] for root in roots]
    with Fleet.start(REPLICAS, ARGS, per) as fleet, fleet.gateway("cache_aware", CACHE_AWARE) as url:
        yield Setup(fleet, url, roots)


def _chat(client: openai.OpenAI, opening: str, turns: int = 3) -> list[int]:
    """One multi-turn chat; the cached prompt tokens of each turn."""
    messages: list[dict[str, str]] = [{"role": "user", "content": opening}]
    cached: list[int] = []
    for t in range(turns):
        r = client.chat.completions.create(model="default", messages=messages, max_tokens=6)  # type: ignore[arg-type]
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        cached.append(r.usage.prompt_tokens_details.cached_tokens or 0)
        messages += [
            {"role": "assistant", "content": r.choices[0].message.content or ""},
            {"role": "user", "content": f"Say more about point {t + 1}, please."},
        ]
    return cached


OPENINGS = [
    "Tell me about the tides of the North Sea.",
    "How do bees find their way back to the hive?",
    "Explain how a steam locomotive works.",
    "What makes sourdough bread rise?",
    "Describe the life cycle of a star.",
    "Why do cats purr when they are content?",
    "How is glass made from sand?",
    "What causes the northern lights?",
]


def test_later_turns_land_on_the_replica_holding_their_prefix(setup: Setup) -> None:
    before = [r.metric("ballast_prompt_tokens_total") for r in setup.fleet.replicas]
    client = setup.client()
    with ThreadPoolExecutor(4) as pool:  # four chats at a time, eight in all
        chats = list(pool.map(lambda o: _chat(client, o), OPENINGS))
    for opening, cached in zip(OPENINGS, chats, strict=True):
        assert cached[0] == 0, (opening, cached)  # a fresh chat has nothing to reuse
        assert all(c > 0 for c in cached[1:]), (opening, cached)  # every later turn found its prefix
    served = [
        r.metric("ballast_prompt_tokens_total") - b for r, b in zip(setup.fleet.replicas, before, strict=True)
    ]
    assert sum(s > 0 for s in served) >= 2, served  # the chats were spread, not pinned to one replica


def _requests_seen(setup: Setup, i: int) -> float:
    return setup.fleet.replicas[i].metric("ballast_requests_total")


def _burst(setup: Setup, n: int, tag: str) -> int:
    """n one-turn chats at once through the gateway; how many finished (an error raises)."""
    client = setup.client()

    def one(k: int) -> str:
        r = client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": f"{tag} question {k}: name a colour."}],
            max_tokens=4,
        )
        return r.choices[0].finish_reason

    with ThreadPoolExecutor(n) as pool:
        return sum(reason in ("length", "stop") for reason in pool.map(one, range(n)))


def test_a_critical_replica_leaves_the_rotation_and_rejoins_at_ok(setup: Setup) -> None:
    target = setup.fleet.replicas[0]
    setup.set_level(0, Level.CRITICAL)
    wait_until(lambda: httpx.get(target.url + "/ready").status_code == 503, 10, "replica 0 at CRITICAL")
    # Before the gateway's next probe it may still pick replica 0: the 503 it gets is retried on a
    # sibling, so clients see none.
    assert _burst(setup, 6, "early") == 6
    left_s = wait_until(
        lambda: target.url not in Fleet.routable(setup.gateway),
        4 * PROBE_INTERVAL_S + 5,
        "smg drops replica 0",
    )
    seen = _requests_seen(setup, 0)
    assert _burst(setup, 6, "drained") == 6
    assert _requests_seen(setup, 0) == seen  # no new work reached it, not even to be refused
    print(f"smg stopped routing to the CRITICAL replica after {left_s:.2f} s")

    setup.set_level(0, Level.OK)
    wait_until(
        lambda: target.url in Fleet.routable(setup.gateway), 4 * PROBE_INTERVAL_S + 5, "smg re-adds replica 0"
    )
    for k in range(10):  # cache-aware routing sends a new prefix to the least-used replica: this one
        # (a long new text, so what it shares with earlier prompts, the chat template's lead, is
        # under the cache threshold's share of it and smg routes it by load)
        words = random.Random(k).choices(WORDS, k=200)  # ~1,200 characters, ~250 tokens
        _burst(setup, 3, f"back {k}: " + " ".join(words))
        if _requests_seen(setup, 0) > seen:
            break
    assert _requests_seen(setup, 0) > seen, "replica 0 got no traffic back at OK"


def test_a_replica_killed_mid_load_costs_only_its_in_flight_requests(setup: Setup) -> None:
    victim = setup.fleet.replicas[2]
    client = setup.client()
    started: set[int] = set()

    def stream(k: int) -> str:
        try:
            s = client.chat.completions.create(
                model="default",
                messages=[{"role": "user", "content": f"Story {k}: write a long tale about a lighthouse."}],
                max_tokens=64,
                stream=True,
            )
            for chunk in s:
                started.add(k)
                if chunk.choices and chunk.choices[0].finish_reason:
                    return chunk.choices[0].finish_reason
            return "cut"  # the stream ended without a finish reason: its replica died
        except (openai.APIError, httpx.HTTPError):
            return "error"

    n = 6
    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(stream, k) for k in range(n)]
        wait_until(lambda: len(started) >= n, 240, "every stream's first token")
        in_flight = int(victim.metric("vllm:num_requests_running"))
        victim.kill()
        outcomes = [f.result() for f in futures]
    failed = sum(o not in ("length", "stop") for o in outcomes)
    assert failed <= in_flight, (outcomes, in_flight)
    # Afterwards nothing fails: the gateway retries a request the dead replica refuses to connect,
    # and drops it from the rotation at its next probe.
    assert _burst(setup, 6, "after") == 6
    wait_until(
        lambda: victim.url not in Fleet.routable(setup.gateway), 4 * PROBE_INTERVAL_S + 5, "smg drops it"
    )
    assert _burst(setup, 6, "later") == 6
