"""Scenario 2, soak: mixed load for a while against `ballast serve` on CPU (streaming and not,
short and long, chat and completions, prompts that share prefixes and multi-turn chats that
extend earlier ones), sampling the server's RSS, KV pool, prefix-cache blocks and checkpoint pool
every few seconds. Every request must complete (no refusal is expected at this load) and the
figures must level off rather than grow; a PNG plot is written when matplotlib is installed.

    python tests/reliability/soak.py --minutes 20 --out soak.json --plot docs/reliability/soak.png
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import openai
from harness import Server, ballast_serve, total, wait_idle

SYSTEMS = [
    f"You are assistant number {i}. Answer briefly and politely, in plain English, and never use lists."
    for i in range(4)
]
EXAMPLES: list[str] = []  # the first few messages of each failure kind
TOPICS = ["rivers", "bread", "clocks", "owls", "glass", "maps", "salt", "bridges", "tea", "snow"]


def worker(url: str, seed: int, stop: threading.Event, outcomes: Counter[str], lock: threading.Lock) -> None:
    rnd = random.Random(seed)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    history: list[dict[str, str]] = []
    while not stop.is_set():
        long = rnd.random() < 0.25
        max_tokens = rnd.choice((96, 160)) if long else rnd.choice((4, 16, 32))
        stream = rnd.random() < 0.5
        try:
            if rnd.random() < 0.7:  # chat, sharing one of four system prompts; half continue the last turn
                if not history or rnd.random() < 0.5 or len(history) > 6:
                    history = [{"role": "system", "content": rnd.choice(SYSTEMS)}]
                history.append(
                    {
                        "role": "user",
                        "content": f"Tell me about {rnd.choice(TOPICS)}."
                        + (" Say more." * 30 if long else ""),
                    }
                )
                if stream:
                    parts = [
                        c.choices[0].delta.content or ""
                        for c in client.chat.completions.create(
                            model="x", messages=history, max_tokens=max_tokens, stream=True
                        )
                        if c.choices
                    ]  # type: ignore[arg-type]
                    text = "".join(parts)
                else:
                    text = (
                        client.chat.completions.create(model="x", messages=history, max_tokens=max_tokens)
                        .choices[0]
                        .message.content
                        or ""
                    )  # type: ignore[arg-type]
                history.append({"role": "assistant", "content": text})
            else:
                prompt = f"{rnd.choice(SYSTEMS)} The word of the day is {rnd.choice(TOPICS)}."
                if stream:
                    for _ in client.completions.create(
                        model="x", prompt=prompt, max_tokens=max_tokens, stream=True
                    ):
                        pass
                else:
                    client.completions.create(model="x", prompt=prompt, max_tokens=max_tokens)
            kind = "completed"
        except openai.APIStatusError as exc:
            kind = str(exc.status_code)
            message = exc.message
        except Exception as exc:  # noqa: BLE001 - counted and shown, never hidden
            kind = type(exc).__name__
            message = str(exc)
        else:
            message = ""
        with lock:
            outcomes[kind] += 1
            if message and outcomes[kind] <= 3:
                EXAMPLES.append(f"{kind}: {message[:300]}")


def sample(server: Server, t0: float) -> dict[str, float]:
    m = server.metrics()
    return {
        "t_s": time.monotonic() - t0,
        "rss_mib": server.rss_bytes / 2**20,
        "kv_pool_mib": total(m, "ballast_kv_pool_bytes") / 2**20,
        "kv_blocks_used": total(m, "ballast_kv_blocks", state="used"),
        "kv_blocks_cached": total(m, "ballast_kv_blocks_cached"),
        "checkpoint_pool_mib": total(m, "ballast_checkpoint_pool_bytes") / 2**20,
        "requests": total(m, "ballast_requests_total"),
        "slots_active": total(m, "ballast_slots_active"),
        "preemptions": total(m, "ballast_kv_preemptions_total"),
        "prompt_tokens_reused": total(m, "ballast_prompt_tokens_reused_total"),
        "prompt_tokens": total(m, "ballast_prompt_tokens_total"),
    }


def run(
    minutes: float, clients: int = 8, every_s: float = 5.0, extra: tuple[str, ...] = ()
) -> dict[str, Any]:
    outcomes: Counter[str] = Counter()
    lock = threading.Lock()
    stop = threading.Event()
    with ballast_serve(
        ["--max-num-seqs", "8", "--max-model-len", "1024", "--served-model-name", "x", *extra]
    ) as server:
        t0 = time.monotonic()
        samples = [sample(server, t0)]
        threads = [
            threading.Thread(target=worker, args=(server.url, i, stop, outcomes, lock), daemon=True)
            for i in range(clients)
        ]
        for t in threads:
            t.start()
        while time.monotonic() - t0 < minutes * 60:
            time.sleep(every_s)
            samples.append(sample(server, t0))
        stop.set()
        for t in threads:
            t.join(300)
        idle = wait_idle(server)
        samples.append(sample(server, t0))
    third = max(1, len(samples) // 3)
    mid, last = samples[third : 2 * third], samples[2 * third :]
    return {
        "minutes": minutes,
        "clients": clients,
        "outcomes": dict(outcomes),
        "rss_start_mib": samples[0]["rss_mib"],
        "rss_max_mib": max(s["rss_mib"] for s in samples),
        "rss_mid_third_max_mib": max(s["rss_mib"] for s in mid),
        "rss_last_third_max_mib": max(s["rss_mib"] for s in last),
        "rss_end_mib": samples[-1]["rss_mib"],
        "kv_pool_max_mib": max(s["kv_pool_mib"] for s in samples),
        "checkpoint_pool_max_mib": max(s["checkpoint_pool_mib"] for s in samples),
        "idle": idle,
        "failure_examples": EXAMPLES[:12],
        "samples": samples,
    }


def plot(figures: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = figures["samples"]
    t = [x["t_s"] / 60 for x in s]
    fig, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    axes[0].plot(t, [x["rss_mib"] for x in s], label="server RSS")
    axes[0].plot(t, [x["kv_pool_mib"] for x in s], label="KV pool (live segments)")
    axes[0].plot(t, [x["checkpoint_pool_mib"] for x in s], label="checkpoint pool")
    axes[0].set_ylabel("MiB")
    axes[1].plot(t, [x["kv_blocks_used"] for x in s], label="KV blocks used")
    axes[1].plot(t, [x["kv_blocks_cached"] for x in s], label="of which prefix cache only")
    axes[1].set_ylabel("blocks")
    axes[2].plot(t, [x["requests"] for x in s], label="requests finished")
    axes[2].set_ylabel("requests")
    axes[2].set_xlabel("minutes")
    for ax in axes:
        ax.legend(loc="upper left")
        ax.grid(alpha=0.3)
    fig.suptitle(f"ballast soak on CPU: {figures['clients']} clients, mixed load, {figures['minutes']:g} min")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


def main() -> None:
    ap = argparse.ArgumentParser(description="scenario 2: soak")
    ap.add_argument("--minutes", type=float, default=20)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--out")
    ap.add_argument("--plot")
    ap.add_argument("serve_args", nargs="*", help="more `ballast serve` flags (after --)")
    a = ap.parse_args()
    figures = run(a.minutes, a.clients, extra=tuple(a.serve_args))
    for k, v in figures.items():
        if k != "samples":
            print(f"  {k:<24} {v}")
    if a.out:
        Path(a.out).write_text(json.dumps(figures, indent=2) + "\n")
    if a.plot:
        plot(figures, a.plot)


if __name__ == "__main__":
    main()
