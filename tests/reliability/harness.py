"""Shared pieces of the reliability scenarios (tests/reliability/*.py).

A scenario drives a real `ballast serve` child process (the product as an operator runs it) on a
free localhost port with the official `openai` client, then checks through /metrics that slots,
queue and KV blocks are back to idle, and reads the child's RSS with psutil. Scenarios are
scripts (`python tests/reliability/NAME.py --help`) that print a table and write JSON; their
`run()` is also called with small figures by the tests in this folder.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

_TESTS = Path(__file__).resolve().parents[1]
for _p in (_TESTS, _TESTS / "integration"):  # fake_engine, memfixtures; serverproc
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from serverproc import serve_subprocess  # noqa: E402

MODEL = "builtin:tiny-llama"
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?) (\S+)$")


@dataclass
class Server:
    url: str
    pid: int
    log: list[str]

    @property
    def rss_bytes(self) -> int:
        return int(psutil.Process(self.pid).memory_info().rss)

    def metrics(self) -> dict[str, float]:
        return scrape(self.url)


@contextmanager
def ballast_serve(
    args: Sequence[str], env: dict[str, str] | None = None, timeout_s: float = 180.0
) -> Iterator[Server]:
    """`ballast serve --model builtin:tiny-llama ARGS` on a free port of 127.0.0.1."""
    lines: list[str] = []
    full = ["--model", MODEL, *args] if "--model" not in args else list(args)
    with serve_subprocess(full, env=env, timeout_s=timeout_s, output=lines) as (url, proc):
        yield Server(url, proc.pid, lines)


def scrape(url: str) -> dict[str, float]:
    """Every sample on /metrics, keyed by name{labels} as Prometheus prints them."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        m = _SAMPLE.match(line)
        if m and not line.startswith("#"):
            out[m.group(1)] = float(m.group(2))
    return out


def total(metrics: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in metrics.items() if k.split("{")[0] == name and all(w in k for w in want))


def idle_figures(metrics: dict[str, float]) -> dict[str, float]:
    return {
        "slots_active": total(metrics, "ballast_slots_active"),
        "queue_depth": total(metrics, "ballast_queue_depth"),
        # blocks running sequences hold (the prefix cache's entries are kept on purpose)
        "kv_blocks_used": total(metrics, "ballast_kv_blocks", state="used")
        - total(metrics, "ballast_kv_blocks_cached"),
        "kv_blocks_cached": total(metrics, "ballast_kv_blocks_cached"),
        "checkpoint_pool_bytes": total(metrics, "ballast_checkpoint_pool_bytes"),
    }


def wait_idle(server: Server, timeout_s: float = 60.0) -> dict[str, float]:
    """Wait (bounded) until no slot, queue entry or KV block is held; the figures at the end."""
    deadline = time.monotonic() + timeout_s
    while True:
        figures = idle_figures(server.metrics())
        if figures["slots_active"] == figures["queue_depth"] == figures["kv_blocks_used"] == 0:
            return figures
        if time.monotonic() > deadline:
            raise AssertionError(f"not idle after {timeout_s} s: {figures}")
        time.sleep(0.1)


def pct(values: Sequence[float], q: float) -> float:
    """The q-th percentile (nearest rank); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def report(title: str, figures: dict[str, object], out: str | None) -> None:
    """Print the figures as a two-column table; write them as JSON to `out` if given."""
    print(f"\n{title}")
    width = max(len(k) for k in figures)
    for k, v in figures.items():
        shown = f"{v:.3f}" if isinstance(v, float) else str(v)
        print(f"  {k:<{width}}  {shown}")
    if out:
        Path(out).write_text(json.dumps(figures, indent=2) + "\n")
