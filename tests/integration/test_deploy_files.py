"""The files in deploy/ stay true to the server: the alert rules are well formed and every metric
they (and docs/OPERATIONS.md) name is on a live server's /metrics (with a GPU in its snapshot), the
scrape job is the one the rules select, and the systemd unit's command line and environment pass
the CLI's strict configuration path."""

from __future__ import annotations

import configparser
import re
import shlex
from pathlib import Path
from typing import Any

import httpx
import yaml
from ballast.memory.config import MemoryConfig
from ballast.memory.device import DieReading, StaticDeviceReader
from ballast.memory.pool import CheckpointPool
from ballast.memory.types import GiB, Level
from ballast.memory.watch import MemWatch
from ballast.scheduler.config import SchedulerConfig
from ballast.server.app import create_app
from ballast.server.cli import LAYERS, OTHER_VARIABLES, build_parser
from ballast.server.config import ServerConfig, build, unknown_variables
from ballast.server.kv_events import KVEventsConfig
from ballast.server.kv_publisher import KVEventPublisher
from fake_engine import FakeEngine
from memfixtures import level_tree
from prometheus_client.parser import text_string_to_metric_families
from serverproc import running_server

from ballast.settings import settings_of

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SEVERITIES = {"warning", "critical"}
METRIC = r"\bballast_[a-z0-9_]+"


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load((DEPLOY / "prometheus" / "ballast.rules.yml").read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def test_alert_rules_are_well_formed() -> None:
    found = rules()
    names = [r["alert"] for r in found]
    assert names and len(names) == len(set(names))
    for r in found:
        assert set(r) == {"alert", "expr", "for", "labels", "annotations"}, r["alert"]
        assert r["labels"]["severity"] in SEVERITIES and r["annotations"]["summary"]
        assert re.fullmatch(r"\d+[smh]", r["for"]), r["alert"]
        assert r["expr"].count("(") == r["expr"].count(")"), r["alert"]


def test_the_scrape_job_is_the_one_the_rules_select() -> None:
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "scrape.yml").read_text())
    jobs = {job["job_name"] for job in scrape["scrape_configs"]}
    selected = {m for r in rules() for m in re.findall(r'job="([^"]+)"', r["expr"])}
    assert selected and selected <= jobs
    assert scrape["rule_files"] == ["ballast.rules.yml"]


def test_every_metric_the_rules_and_the_guide_name_is_served(tmp_path: Path) -> None:
    in_rules = {m for r in rules() for m in re.findall(METRIC, r["expr"])}
    in_guide = set(re.findall(METRIC, (DEPLOY.parent / "docs" / "OPERATIONS.md").read_text()))
    assert len(in_rules) >= 5 and len(in_guide) >= 10
    cfg = MemoryConfig(root=str(tmp_path))
    level_tree(tmp_path, Level.OK, config=cfg)
    watch = MemWatch(cfg, StaticDeviceReader([DieReading(0, "test-gpu", 80 * GiB, 70 * GiB)]))
    watch.ledger.register_die(0, 80 * GiB, 70 * GiB)  # as the engine's loader does before the weights
    pool = CheckpointPool(
        lambda: watch.read().host.effective_total_bytes, 0.25, 8, 1, pin=False
    )  # as `ballast serve` has
    # With --kv-events-endpoint set, as the guide's KV-event series need.
    kv_events = KVEventPublisher(KVEventsConfig(endpoint=f"ipc://{tmp_path}/kv-events"))
    app = create_app(
        ServerConfig(),
        SchedulerConfig(),
        lambda: FakeEngine(kv_blocks=64, gpu_die=0),
        memwatch=watch,
        pool=pool,
        collectors=(kv_events.collector(),),
    )
    with running_server(app) as url:
        body = {"model": "fake-model", "prompt": "the cat", "max_tokens": 3, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200 and "[DONE]" in r.read().decode()
        families = list(text_string_to_metric_families(httpx.get(url + "/metrics").text))
    kv_events.stop()
    served = {f.name for f in families} | {s.name for f in families for s in f.samples}
    # A labelled counter with no sample yet still declares its family (name without _total).
    for source, named in (("the alert rules", in_rules), ("docs/OPERATIONS.md", in_guide)):
        missing = {
            m for m in named if m not in served and re.sub(r"_(total|bucket|count|sum)$", "", m) not in served
        }
        assert not missing, f"{source} name metrics the server does not serve: {sorted(missing)}"


def test_systemd_unit_passes_the_configuration_path() -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    text = (DEPLOY / "systemd" / "ballast.service").read_text()
    # configparser keeps one value per key; systemd allows Environment= many times.
    env = dict(line.split("=", 2)[1:] for line in text.splitlines() if line.startswith("Environment="))
    unit.read_string(text)
    argv = shlex.split(unit["Service"]["ExecStart"])
    assert argv[0].endswith("/ballast") and argv[1] == "serve"
    parser, _ = build_parser()
    args = parser.parse_args(argv[1:])
    for layer in LAYERS:
        build(layer, args, env)  # raises ConfigError on any bad value
    assert env and unknown_variables(env, LAYERS, OTHER_VARIABLES) == []
    assert unit["Service"]["Restart"] == "on-failure"
    assert unit["Service"]["MemoryMax"] and unit["Service"]["MemoryHigh"]


def test_the_guide_names_every_setting() -> None:
    guide = (DEPLOY.parent / "docs" / "OPERATIONS.md").read_text()
    missing = [
        f"{s.flag} ({s.env})"
        for layer in LAYERS
        for s in settings_of(layer)
        if f"`{s.flag}`" not in guide or f"`{s.env}`" not in guide
    ]
    assert not missing, f"docs/OPERATIONS.md does not list: {missing}"
    assert all(f"`{name}`" in guide for name in OTHER_VARIABLES)
