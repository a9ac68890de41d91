"""/ready follows the queue wait, behind the real gateway (`smg`): a replica whose queue a new
request would wait near --max-queue-wait-s in turns /ready 503 before it refuses anything for its
wait; smg stops routing to it, so clients through the gateway see no refusal; once its queue
drains it turns 200 and smg routes to it again."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from ballast.bench.fleet import PROBE_INTERVAL_S, Fleet, FleetError, smg_binary, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # timed: run alone (see pyproject's markers)

BOUND_S = 10.0
ARGS = ["--model", "builtin:tiny-llama", "--served-model-name", "m", "--max-num-seqs", "1"]
ARGS += ["--max-model-len", "2048", "--max-queue-wait-s", str(BOUND_S)]


def posts(lines: list[str]) -> int:
    return sum("POST /v1/chat/completions" in x for x in list(lines))


def test_a_replica_turns_unready_before_refusing_and_smg_routes_around_it() -> None:
    try:
        smg_binary()
    except FleetError as exc:
        pytest.skip(str(exc))
    with Fleet.start(2, ARGS) as fleet, fleet.gateway("round_robin") as gateway:
        busy = fleet.replicas[0]
        direct = openai.OpenAI(base_url=busy.url + "/v1", api_key="x", max_retries=0, timeout=300)
        msgs = [{"role": "user", "content": "count"}]
        for _ in range(2):  # its steps are measured (the first of each size is not counted)
            direct.chat.completions.create(model="m", messages=msgs, max_tokens=64)  # type: ignore[arg-type]
        t0 = time.monotonic()
        direct.chat.completions.create(model="m", messages=msgs, max_tokens=200)  # type: ignore[arg-type]
        per_token = (time.monotonic() - t0) / 200
        long = max(50, min(1900, int(0.3 * BOUND_S / per_token)))  # each ~0.3 of the bound

        outcomes: list[str] = []

        def stream() -> None:
            try:
                s = direct.chat.completions.create(model="m", messages=msgs, max_tokens=long, stream=True)  # type: ignore[arg-type]
                for _ in s:
                    pass
                outcomes.append("200")
            except openai.APIStatusError as exc:
                outcomes.append(str(exc.status_code))

        threads: list[threading.Thread] = []
        while httpx.get(busy.url + "/ready").status_code == 200:
            assert len(threads) < 12, "the replica never turned unready"
            threads.append(threading.Thread(target=stream, daemon=True))
            threads[-1].start()
            time.sleep(0.3)
        # It turned before refusing anything for its wait.
        assert busy.metric('ballast_requests_total{outcome="queue_wait"}') == 0
        assert "queue wait" in httpx.get(busy.url + "/ready").json()["reason"]
        wait_until(lambda: busy.url not in Fleet.routable(gateway), 4 * PROBE_INTERVAL_S + 5, "smg drops it")

        seen = posts(busy.lines)
        client = openai.OpenAI(base_url=gateway + "/v1", api_key="x", max_retries=0, timeout=120)
        for k in range(6):  # through the gateway: none refused, none sent to the busy replica
            r = client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": f"short {k}"}],
                max_tokens=4,  # type: ignore[arg-type]
            )
            assert r.choices[0].finish_reason in ("length", "stop")
        assert posts(busy.lines) == seen

        # Its queue drains: ready again, and smg routes to it again.
        wait_until(lambda: busy.url in Fleet.routable(gateway), 120, "smg re-adds it", every_s=0.2)
        for t in threads:
            t.join(timeout=300)
        assert outcomes == ["200"] * len(threads)  # every request it queued was served
