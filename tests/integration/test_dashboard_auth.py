"""With --api-key the dashboard follows the key (issue 31, item 10): /dashboard and
/dashboard/state (which names the model /v1/models keeps behind the key) answer 401 without it,
and take it as a Bearer header or as the password of HTTP Basic (what a browser can send);
/health, /ready and /metrics stay open for probes and scrapes. A real uvicorn server."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from ballast.memory.config import MemoryConfig
from ballast.memory.types import Level
from ballast.memory.watch import MemWatch
from ballast.scheduler.config import SchedulerConfig
from ballast.server.app import create_app
from ballast.server.config import ServerConfig
from fake_engine import FakeEngine
from memfixtures import level_tree
from serverproc import running_server

KEY = "sk-dash-4c2e91"


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root: Path = tmp_path_factory.mktemp("dash-auth")
    level_tree(root, Level.OK)
    watch = MemWatch(MemoryConfig(root=str(root)))
    app = create_app(ServerConfig(api_key=KEY), SchedulerConfig(), FakeEngine, memwatch=watch)
    with running_server(app) as served:
        yield served


@pytest.mark.parametrize("path", ["/dashboard", "/dashboard/state"])
def test_the_dashboard_is_behind_the_key(url: str, path: str) -> None:
    for wrong in (None, "Bearer sk-wrong", basic("admin", "sk-wrong"), basic(KEY, ""), "Basic !!!"):
        r = httpx.get(url + path, headers={"Authorization": wrong} if wrong else {})
        assert r.status_code == 401, (path, wrong)
        assert r.json()["error"]["code"] == "invalid_api_key" and "fake-model" not in r.text
        assert r.headers["www-authenticate"].startswith("Basic")  # a browser asks for it
    for right in (f"Bearer {KEY}", basic("anyone", KEY)):
        r = httpx.get(url + path, headers={"Authorization": right})
        assert r.status_code == 200, (path, right)
    state = httpx.get(url + "/dashboard/state", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert "fake-model" in str(state)  # what the key protects


def test_probes_and_scrapes_stay_open(url: str) -> None:
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(url + path).status_code == 200, path
    assert httpx.get(url + "/v1/models").status_code == 401
