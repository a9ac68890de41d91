"""What gateways read of a live `ballast serve` (real engine, builtin:tiny-llama, a temp /proc tree
for its memory level): the vLLM-named series with exactly the labels gateways look up, KV usage
that rises with running requests and reads full at CRITICAL, and /v1/models listing every name the
server answers to (an in-process app on the fake engine)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from ballast.memory.config import MemoryConfig
from ballast.memory.types import Level
from ballast.scheduler.config import SchedulerConfig
from ballast.server.app import create_app
from ballast.server.config import ServerConfig
from ballast.server.gateway_metrics import SERIES
from fake_engine import FakeEngine
from memfixtures import level_tree
from prometheus_client.parser import text_string_to_metric_families
from serverproc import running_server, serve_subprocess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    root = tmp_path_factory.mktemp("gateway-metrics")
    level_tree(root, Level.OK, config=MemoryConfig(root=str(root)))
    args = ["--model", "builtin:tiny-llama", "--max-model-len", "512", "--max-num-seqs", "4"]
    args += ["--memory-root", str(root), "--memwatch-poll-s", "0.05"]
    with serve_subprocess(args) as (url, _):
        yield url, root


def gateway_samples(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            if s.name in SERIES:
                out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def usage(url: str) -> float:
    ((_, value),) = gateway_samples(url)["vllm:kv_cache_usage_perc"]
    return value


def test_every_series_is_served_with_the_labels_gateways_read(server: tuple[str, Path]) -> None:
    url, _ = server
    samples = gateway_samples(url)
    assert set(samples) == set(SERIES)
    for name, rows in samples.items():
        ((labels, _),) = rows
        assert tuple(sorted(labels)) == tuple(sorted(SERIES[name])), name
    ((info, _),) = samples["vllm:cache_config_info"]
    assert int(info["block_size"]) > 0 and int(info["num_gpu_blocks"]) > 0
    ((lora, stamp),) = samples["vllm:lora_requests_info"]
    assert lora["max_lora"] == "0" and abs(stamp - time.time()) < 60


def test_the_gateway_page_serves_the_same_series_alone(server: tuple[str, Path]) -> None:
    """/metrics/gateway: the vLLM-named series only, in the text format Prometheus parses, with the
    labels and (but for the reading's time) the values of /metrics."""
    url, _ = server
    r = httpx.get(url + "/metrics/gateway")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    page: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(r.text):
        assert family.type == "gauge" and family.documentation, family.name
        for s in family.samples:
            page.setdefault(s.name, []).append((s.labels, s.value))
    full = gateway_samples(url)
    assert set(page) == set(full) == set(SERIES)
    for name in SERIES:
        if name != "vllm:lora_requests_info":
            assert page[name] == full[name], name
        ((labels, _),) = page[name]
        assert tuple(sorted(labels)) == tuple(sorted(SERIES[name]))


def test_models_lists_every_name_the_server_answers_to() -> None:
    # `ballast serve --model default` answers to "default" beside the model's own name: both are
    # listed (a gateway routes only to the ids it finds there) and both are accepted.
    app = create_app(ServerConfig(), SchedulerConfig(), FakeEngine, model_aliases=("default",))
    with running_server(app) as url:
        ids = [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
        assert ids == ["fake-model", "default"]
        for name in ids:
            body = {"model": name, "prompt": "the cat", "max_tokens": 1}
            assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
            assert httpx.get(url + f"/v1/models/{name}").json()["id"] == name


def test_usage_rises_with_running_requests_and_is_full_at_critical(server: tuple[str, Path]) -> None:
    url, root = server
    assert usage(url) == 0.0  # idle: blocks the prefix cache keeps count as free
    body = {"model": "builtin:tiny-llama", "prompt": "once upon a time", "max_tokens": 48, "stream": True}
    seen: list[tuple[float, float]] = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i == 3:
                s = gateway_samples(url)
                seen.append((s["vllm:num_requests_running"][0][1], s["vllm:kv_cache_usage_perc"][0][1]))
    ((running, busy),) = seen
    assert running == 1 and 0 < busy < 1  # one of four slots, a few blocks of a roomy pool
    level_tree(root, Level.CRITICAL, config=MemoryConfig(root=str(root)))
    deadline = time.monotonic() + 20
    while usage(url) < 1.0:
        assert time.monotonic() < deadline, "usage never read full at CRITICAL"
        time.sleep(0.05)
    level_tree(root, Level.OK, config=MemoryConfig(root=str(root)))
    deadline = time.monotonic() + 20
    while usage(url) > 0.0:
        assert time.monotonic() < deadline, "usage never came back down at OK"
        time.sleep(0.05)
