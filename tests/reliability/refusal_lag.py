"""How long a refused request waits, at the client and at the server, when many arrive at once.

    python tests/reliability/refusal_lag.py [--clients 64] [--per-client 3] [--prompt-words 700]
        [--model default] [--after-prompt] [--out FILE]

One server (`ballast serve`, `--max-num-seqs 1 --max-queue 0`: every request is refused with 429
`queue_full`, a refusal no prompt changes); `--clients` threads each send `--per-client` streaming
chats of `--prompt-words` words (~2.7k tokens at 700) back to back. Printed and written as JSON:
the client's time from sending to the status line (p50, p99), the server's own
`ballast_refusal_seconds` (mean), the statuses. Before the server asked for such refusals ahead of
building the prompt (s26), each waited behind the others' chat templates and tokens on the event
loop (8.6 ms a 2.7k-token prompt on a 2-core CPU). The clients share the machine with the server.

`--after-prompt`: answers that need the prompt instead. The queue is open and each chat asks for
4,000 new tokens beside its ~2.7k-token prompt, past the 4,096-token context: a 400 that only the
prompt's length decides, so each waits for its own prompt to be built (since s27 in a worker
thread, before on the event loop behind every other request's).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import threading
import time
from pathlib import Path

import httpx
from ballast.bench.http_load import free_port, serve_command, server

_SERVER = re.compile(r"^ballast_refusal_seconds_(sum|count)\{[^}]*\} (\S+)$", re.M)


def run(
    model: str, clients: int, per_client: int, words: int, after_prompt: bool = False
) -> dict[str, object]:
    text = " ".join(f"word{i}" for i in range(words))
    port = free_port()
    args = ("--max-num-seqs", "1", *(() if after_prompt else ("--max-queue", "0")), "--max-model-len", "4096")
    max_tokens = 4000 if after_prompt else 64
    with server(serve_command(model, port, *args), {}, "/ready", port) as base:
        name = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
        waits: list[float] = []
        statuses: dict[int, int] = {}
        lock = threading.Lock()

        def client(c: int) -> None:
            with httpx.Client(timeout=60) as http:
                for r in range(per_client):
                    body = {
                        "model": name,
                        "messages": [{"role": "user", "content": f"Story {c}-{r}. {text}"}],
                        "max_tokens": max_tokens,
                        "stream": True,
                    }
                    sent = time.monotonic()
                    with http.stream("POST", base + "/v1/chat/completions", json=body) as resp:
                        waited = time.monotonic() - sent
                        resp.read()
                    with lock:
                        waits.append(waited)
                        statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1

        threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        figures = {kind: 0.0 for kind in ("sum", "count")}
        for kind, value in _SERVER.findall(httpx.get(base + "/metrics", timeout=10).text):
            figures[kind] += float(value)
    waits.sort()
    return {
        "model": name,
        "clients": clients,
        "per_client": per_client,
        "prompt_words": words,
        "after_prompt": after_prompt,
        "statuses": statuses,
        "client_p50_s": statistics.median(waits),
        "client_p99_s": waits[min(len(waits) - 1, int(len(waits) * 0.99))],
        "server_mean_s": figures["sum"] / figures["count"] if figures["count"] else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--per-client", type=int, default=3)
    ap.add_argument("--prompt-words", type=int, default=700)
    ap.add_argument("--after-prompt", action="store_true", help="400s the prompt's length decides")
    ap.add_argument("--out", default="refusal_lag.json")
    a = ap.parse_args()
    r = run(a.model, a.clients, a.per_client, a.prompt_words, a.after_prompt)
    print(
        f"{r['clients']} clients x {r['per_client']} chats of {r['prompt_words']} words: "
        f"statuses {r['statuses']}; "
        f"client p50 {r['client_p50_s']:.3f} s, p99 {r['client_p99_s']:.3f} s; "
        f"server mean {r['server_mean_s']}"
    )
    Path(a.out).write_text(json.dumps(r, indent=1) + "\n")


if __name__ == "__main__":
    main()
