"""The live page /dashboard and its JSON /dashboard/state, on a real server whose memory signals
come from a temp /proc + cgroup tree (so a test can force the level), in headless Chromium."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from ballast.memory.config import MemoryConfig
from ballast.memory.device import DieReading, StaticDeviceReader
from ballast.memory.types import GiB, Level
from ballast.memory.watch import MemWatch
from ballast.scheduler.config import SchedulerConfig
from ballast.server.app import create_app
from ballast.server.config import ServerConfig
from browser import CHROMIUM, chromium_page, pixel, png_pixels
from fake_engine import FakeEngine
from memfixtures import level_tree
from serverproc import running_server

NO_BROWSER = "Debian's chromium is not installed (apt-get install chromium; `make ci-tools` does it)"


@contextmanager
def dashboard_server(root: Path, *, step_delay_s: float = 0.0, dashboard: bool = True) -> Iterator[str]:
    root.mkdir(exist_ok=True)
    cfg = MemoryConfig(root=str(root), poll_interval_s=0.05)
    level_tree(root, Level.OK, config=cfg)
    watch = MemWatch(cfg, StaticDeviceReader([DieReading(0, "test-gpu", 80 * GiB, 70 * GiB)]))
    watch.ledger.register_die(0, 80 * GiB, 70 * GiB)
    engine = lambda: FakeEngine(kv_blocks=256, step_delay_s=step_delay_s, gpu_die=0)  # noqa: E731
    app = create_app(ServerConfig(dashboard=dashboard), SchedulerConfig(), engine, memwatch=watch)
    with running_server(app) as url:
        yield url


def force(root: Path, level: Level) -> None:
    level_tree(root, level, config=MemoryConfig(root=str(root)))


def wait_state(
    url: str, check: str, predicate: Callable[[dict[str, Any]], bool], timeout_s: float = 10.0
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    doc: dict[str, Any] = {}
    while time.monotonic() < deadline:
        doc = httpx.get(url + "/dashboard/state").json()
        if predicate(doc):
            return doc
        time.sleep(0.05)
    raise AssertionError(f"{check}: never true within {timeout_s} s; last state {doc}")


def test_page_is_self_contained(tmp_path: Path) -> None:
    with dashboard_server(tmp_path) as url:
        r = httpx.get(url + "/dashboard")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    # Nothing fetched from elsewhere: no absolute URLs in src/href, no script or stylesheet files.
    assert not re.search(r"""(src|href)\s*=\s*["'](https?:)?//""", page)
    assert "<script src" not in page and 'rel="stylesheet"' not in page
    assert 'fetch("dashboard/state"' in page


def test_state_follows_load_and_pressure(tmp_path: Path) -> None:
    with dashboard_server(tmp_path) as url:
        doc = httpx.get(url + "/dashboard/state").json()
        assert doc["phase"] == "ready" and doc["level"] == "OK" and doc["model"] == "fake-model"
        assert doc["ladder"]["level"] == "OK" and not doc["ladder"]["degraded"]
        assert doc["memory"]["gpus"][0]["index"] == 0 and doc["memory"]["host"]["reserve_bytes"] > 0
        assert doc["scheduler"]["kv_pools"] and doc["counters"]["generation_tokens"] == 0
        body = {"model": "fake-model", "prompt": "the cat", "max_tokens": 5}
        assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 200
        doc = httpx.get(url + "/dashboard/state").json()
        assert doc["counters"]["generation_tokens"] == 5 and doc["latency"]["ttft"]["count"] == 1
        assert doc["latency"]["itl"]["count"] == 4 and doc["latency"]["itl"]["buckets"][-1] == [None, 4]

        force(tmp_path, Level.TIGHT)
        # The ladder plan is made by the scheduler, which re-plans when it steps or takes work.
        assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 200
        doc = wait_state(url, "TIGHT", lambda d: d["level"] == "TIGHT")
        assert doc["memory"]["host_level"] == "TIGHT"

        force(tmp_path, Level.CRITICAL)
        doc = wait_state(url, "CRITICAL", lambda d: d["level"] == "CRITICAL")
        assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 503
        doc = httpx.get(url + "/dashboard/state").json()
        assert doc["counters"]["rejections"]["503"] == 1 and doc["ladder"]["level"] == "CRITICAL"
        assert doc["ladder"]["max_slots"] == 1 and doc["scheduler"]["pressure_level"] == "CRITICAL"


def test_dashboard_can_be_turned_off(tmp_path: Path) -> None:
    with dashboard_server(tmp_path, dashboard=False) as url:
        assert httpx.get(url + "/dashboard").status_code == 404
        assert httpx.get(url + "/dashboard/state").status_code == 404


def _badge_rgb(page_png: bytes) -> tuple[int, int, int]:
    image = png_pixels(page_png)
    return pixel(image, 4, 4)  # a corner of the badge, away from its text


@pytest.mark.skipif(CHROMIUM is None, reason=NO_BROWSER)
def test_page_in_chromium_moves_with_load_and_turns_red_at_critical(tmp_path: Path) -> None:
    shots = tmp_path / "screenshots"
    shots.mkdir()
    with (
        dashboard_server(tmp_path / "mem", step_delay_s=0.01) as url,
        chromium_page(url + "/dashboard?every=150") as page,
    ):
        page.wait_for("window.ballastDashboard && window.ballastDashboard.polls >= 3")
        assert page.evaluate("document.getElementById('level').dataset.level") == "OK"
        ok_rgb = _badge_rgb(page.screenshot("#level"))
        assert ok_rgb[1] > ok_rgb[0] + 40, f"the OK badge is not green: {ok_rgb}"
        idle_path = page.evaluate("document.querySelector('#chart-throughput path').getAttribute('d')")
        assert (
            page.evaluate(
                "Math.max(0, ...window.ballastDashboard.series.tokens_per_s.filter(v => v !== null))"
            )
            == 0
        )

        def client() -> None:
            body = {"model": "fake-model", "prompt": "the quick brown fox", "max_tokens": 60, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                assert r.status_code == 200
                r.read()

        clients = [threading.Thread(target=client) for _ in range(6)]
        for t in clients:
            t.start()
        page.wait_for("window.ballastDashboard.series.tokens_per_s.some(v => v > 0)")
        page.wait_for("window.ballastDashboard.series.slots_active.some(v => v > 0)")
        for t in clients:
            t.join(timeout=60)
        page.wait_for("window.ballastDashboard.series.ttft.some(v => v !== null && v > 0)")
        busy_path = page.evaluate("document.querySelector('#chart-throughput path').getAttribute('d')")
        assert busy_path != idle_path
        assert float(page.evaluate("document.getElementById('chart-throughput').dataset.max")) > 0
        (shots / "dashboard-load.png").write_bytes(page.screenshot())

        force(tmp_path / "mem", Level.CRITICAL)
        page.wait_for("document.getElementById('level').dataset.level === 'CRITICAL'")
        page.wait_for("window.ballastDashboard.series.level.includes(3)")
        (shots / "dashboard-critical.png").write_bytes(page.screenshot())
        red = _badge_rgb(page.screenshot("#level"))
        assert red[0] > red[1] + 80 and red[0] > red[2] + 80, f"the CRITICAL badge is not red: {red}"
        assert page.evaluate("document.title") == "ballast · CRITICAL"
        assert page.console_errors() == []
        assert page.evaluate("window.ballastDashboard.failures") == 0
