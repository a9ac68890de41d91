"""A real Prometheus (Debian's `prometheus` package) scraping a real ballast: the alert rules pass
`promtool`, a query reads the pressure level back, the CRITICAL alert fires when the level is
forced, and every query of the Grafana dashboard is valid PromQL over metrics the server serves.
Skips, saying why, where the binaries are absent (`make ci-tools` installs them)."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from ballast.memory.config import MemoryConfig
from ballast.memory.device import DieReading, StaticDeviceReader
from ballast.memory.pool import CheckpointPool
from ballast.memory.types import GiB, Level
from ballast.memory.watch import MemWatch
from ballast.scheduler.config import SchedulerConfig
from ballast.server.app import create_app
from ballast.server.config import ServerConfig
from fake_engine import FakeEngine
from memfixtures import level_tree
from prometheus_client.parser import text_string_to_metric_families
from serverproc import running_server

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
NO_PROMETHEUS = (
    "Debian's prometheus package is not installed (apt-get install prometheus; `make ci-tools` does it)"
)
METRIC = r"\bballast_[a-z0-9_]+"


def grafana_dashboard() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((DEPLOY / "grafana" / "ballast.json").read_text())
    return doc


def grafana_queries() -> list[str]:
    """The PromQL of every panel."""
    return [t["expr"] for p in grafana_dashboard()["panels"] for t in p.get("targets", [])]


def grafana_variables() -> list[str]:
    """Template variables' queries (Grafana's own `label_values(metric, label)`)."""
    return [
        v["query"]["query"]
        for v in grafana_dashboard()["templating"]["list"]
        if isinstance(v.get("query"), dict)
    ]


def as_promql(expr: str) -> str:
    """A Grafana query as Prometheus itself takes it: the dashboard's variables filled in."""
    return expr.replace("$__rate_interval", "5s").replace('instance=~"$instance"', 'instance=~".*"')


@contextmanager
def ballast(root: Path) -> Iterator[str]:
    root.mkdir(exist_ok=True)
    cfg = MemoryConfig(root=str(root), poll_interval_s=0.05)
    level_tree(root, Level.OK, config=cfg)
    watch = MemWatch(cfg, StaticDeviceReader([DieReading(0, "test-gpu", 80 * GiB, 70 * GiB)]))
    watch.ledger.register_die(0, 80 * GiB, 70 * GiB)
    pool = CheckpointPool(
        lambda: watch.read().host.effective_total_bytes, 0.25, 8, 1, pin=False
    )  # as `ballast serve` has
    app = create_app(
        ServerConfig(),
        SchedulerConfig(),
        lambda: FakeEngine(kv_blocks=64, gpu_die=0),
        memwatch=watch,
        pool=pool,
    )
    with running_server(app) as url:
        yield url


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextmanager
def prometheus(workdir: Path, target: str, rules: dict[str, Any]) -> Iterator[str]:
    assert PROMETHEUS is not None
    (workdir / "rules.yml").write_text(yaml.safe_dump(rules))
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": ["rules.yml"],
        "scrape_configs": [
            {"job_name": "ballast", "scrape_interval": "1s", "static_configs": [{"targets": [target]}]}
        ],
    }
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = (workdir / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        until(
            lambda: proc.poll() is None and _ready(url),
            "prometheus ready",
            30,
            lambda: (workdir / "prometheus.log").read_text(),
        )
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/-/ready", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def until(
    check: Callable[[], bool], what: str, timeout_s: float = 30.0, detail: Callable[[], str] = lambda: ""
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout_s} s. {detail()}")


def query(url: str, promql: str) -> list[dict[str, Any]]:
    r = httpx.get(url + "/api/v1/query", params={"query": promql}, timeout=10).json()
    assert r["status"] == "success", (promql, r)
    result: list[dict[str, Any]] = r["data"]["result"]
    return result


def firing(url: str) -> set[str]:
    alerts = httpx.get(url + "/api/v1/alerts", timeout=10).json()["data"]["alerts"]
    return {a["labels"]["alertname"] for a in alerts if a["state"] == "firing"}


def test_grafana_dashboard_queries_only_served_metrics(tmp_path: Path) -> None:
    queries = grafana_queries() + grafana_variables()
    named = {m for q in queries for m in re.findall(METRIC, q)}
    assert len(queries) >= 20 and len(named) >= 25
    with ballast(tmp_path / "mem") as url:
        body = {"model": "fake-model", "prompt": "the cat", "max_tokens": 3}
        assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 200
        families = list(text_string_to_metric_families(httpx.get(url + "/metrics").text))
    served = {f.name for f in families} | {s.name for f in families for s in f.samples}
    missing = {
        m for m in named if m not in served and re.sub(r"_(total|bucket|count|sum)$", "", m) not in served
    }
    assert not missing, (
        f"deploy/grafana/ballast.json queries metrics the server does not serve: {sorted(missing)}"
    )


@pytest.mark.skipif(PROMTOOL is None, reason=NO_PROMETHEUS)
def test_promtool_accepts_the_rules_and_their_unit_tests(tmp_path: Path) -> None:
    assert PROMTOOL is not None
    rules = DEPLOY / "prometheus" / "ballast.rules.yml"
    out = subprocess.run(
        [PROMTOOL, "check", "rules", str(rules)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr
    out = subprocess.run(
        [PROMTOOL, "test", "rules", "ballast.rules.test.yml"],
        capture_output=True,
        text=True,
        check=False,
        cwd=DEPLOY / "prometheus",
    )
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr
    # The Kubernetes PrometheusRule carries the same kind of rules: promtool checks its groups too.
    rule = yaml.safe_load((DEPLOY / "k8s" / "base" / "prometheusrule.yaml").read_text())
    (tmp_path / "k8s-rules.yml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    out = subprocess.run(
        [PROMTOOL, "check", "rules", str(tmp_path / "k8s-rules.yml")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.skipif(PROMETHEUS is None, reason=NO_PROMETHEUS)
def test_prometheus_reads_the_level_and_fires_critical(tmp_path: Path) -> None:
    rules = yaml.safe_load((DEPLOY / "prometheus" / "ballast.rules.yml").read_text())
    for group in rules["groups"]:
        group["interval"] = "1s"
        for rule in group["rules"]:
            rule["for"] = "1s"  # the expressions as shipped; only the waiting is shortened
    with ballast(tmp_path / "mem") as url, prometheus(tmp_path, url.removeprefix("http://"), rules) as prom:
        until(
            lambda: [r["value"][1] for r in query(prom, "ballast_memory_pressure_level")] == ["0"],
            "level 0 scraped",
        )
        assert query(prom, 'up{job="ballast"}')[0]["value"][1] == "1"
        body = {"model": "fake-model", "prompt": "the cat", "max_tokens": 3}
        assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 200
        for q in grafana_queries():  # valid PromQL, as Prometheus 2.x parses it
            query(prom, as_promql(q))
        for variable in grafana_variables():  # label_values(metric, label): the metric has that label
            metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", variable).groups()  # type: ignore[union-attr]
            assert all(label in r["metric"] for r in query(prom, metric)) and query(prom, metric)
        until(
            lambda: bool(query(prom, "ballast_slots_limit")) and bool(query(prom, "ballast_kv_blocks")),
            "scheduler gauges scraped",
        )
        assert "BallastMemoryCritical" not in firing(prom)

        level_tree(tmp_path / "mem", Level.CRITICAL, config=MemoryConfig(root=str(tmp_path / "mem")))
        until(
            lambda: [r["value"][1] for r in query(prom, "ballast_memory_pressure_level")] == ["3"],
            "level 3 scraped",
        )
        until(
            lambda: "BallastMemoryCritical" in firing(prom),
            "BallastMemoryCritical firing",
            30,
            lambda: str(firing(prom)),
        )
        assert {"BallastMemoryTight", "BallastMemoryCritical"} <= firing(prom)
        assert httpx.get(url + "/ready").status_code == 503
