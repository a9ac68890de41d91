"""deploy/ gateway examples stay true to the gateway and to the server: every `smg` flag the script,
the systemd unit and the Kubernetes Deployment pass is one the installed smg accepts; the replica
units pass ballast's strict configuration path; the Kubernetes resources pass `kubernetes-validate`
strictly; the InferencePool and HTTPRoute (CRDs it has no schema for) have exactly the fields their
APIs define; and every metric the endpoint picker's config reads is a series ballast serves."""

from __future__ import annotations

import configparser
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from ballast.bench.fleet import FleetError, smg_binary
from ballast.server.cli import LAYERS, build_parser
from ballast.server.config import build
from ballast.server.gateway_metrics import SERIES

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
GATEWAY = DEPLOY / "k8s" / "gateway"
SYSTEMD = DEPLOY / "systemd"
SCRIPT = DEPLOY / "gateway" / "smg-replicas.sh"
CRD_KINDS = {"InferencePool", "HTTPRoute"}


@pytest.fixture(scope="module")
def smg_flags() -> set[str]:
    try:
        smg = smg_binary()
    except FleetError as exc:
        pytest.skip(str(exc))
    out = subprocess.run([smg, "launch", "--help"], capture_output=True, text=True, check=True).stdout
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]+)", out))


def _flags(argv: list[str]) -> set[str]:
    return {a.split("=", 1)[0] for a in argv if a.startswith("--")}


def _docs(folder: Path) -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    docs: list[dict[str, Any]] = []
    for name in kustomization["resources"]:
        docs += [d for d in yaml.safe_load_all((folder / name).read_text()) if d]
    return docs


def _unit(name: str) -> configparser.ConfigParser:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    unit.read_string((SYSTEMD / name).read_text())
    return unit


def test_the_script_parses_and_passes_only_flags_smg_accepts(smg_flags: set[str]) -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    launch = SCRIPT.read_text().split('"$SMG" launch', 1)[1].split("&\n", 1)[0]
    used = set(re.findall(r"--[a-z][a-z0-9-]+", launch))
    assert {"--worker-urls", "--policy", "--health-check-endpoint"} <= used
    assert used <= smg_flags, used - smg_flags


def test_the_systemd_gateway_fronts_the_replica_units(smg_flags: set[str]) -> None:
    argv = shlex.split(_unit("smg.service")["Service"]["ExecStart"])
    assert argv[0].endswith("/smg") and argv[1] == "launch"
    assert _flags(argv) <= smg_flags, _flags(argv) - smg_flags
    urls = argv[argv.index("--worker-urls") + 1 : argv.index("--policy")]
    ports = [u.rsplit(":", 1)[1] for u in urls]
    assert argv[argv.index("--health-check-endpoint") + 1] == "/ready"
    replica = shlex.split(_unit("ballast@.service")["Service"]["ExecStart"])
    parser, _ = build_parser()
    for port in ports:  # every instance the gateway names starts with a valid configuration
        argv = [a.replace("%i", port) for a in replica[1:]]
        args = parser.parse_args(argv)
        for layer in LAYERS:
            build(layer, args, {})  # raises ConfigError on any bad value
        assert argv[argv.index("--port") + 1] == port
        assert argv[argv.index("--served-model-name") + 1] == "default"


def test_kubernetes_resources_pass_the_schema_and_the_crds_have_their_api_fields() -> None:
    version = kubernetes_validate.latest_version()
    docs = _docs(GATEWAY / "smg") + _docs(GATEWAY / "inference-pool")
    kinds = {d["kind"] for d in docs}
    assert {
        "Deployment",
        "Service",
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "ConfigMap",
    } | CRD_KINDS <= kinds
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(doc, version, strict=True)
            continue
        kubernetes_validate.validate(doc, version, strict=True)
    pool = next(d for d in docs if d["kind"] == "InferencePool")
    # The fields of inference.networking.k8s.io/v1 InferencePool (api/v1/inferencepool_types.go).
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert set(pool) == {"apiVersion", "kind", "metadata", "spec"}
    spec = pool["spec"]
    assert set(spec) <= {"selector", "targetPorts", "appProtocol", "endpointPickerRef"}
    assert set(spec["selector"]) <= {"matchLabels"} and all(set(p) == {"number"} for p in spec["targetPorts"])
    ref = spec["endpointPickerRef"]
    assert set(ref) <= {"group", "kind", "name", "port", "failureMode"} and set(ref["port"]) == {"number"}
    assert ref["failureMode"] in ("FailOpen", "FailClose")
    ballast = yaml.safe_load((DEPLOY / "k8s" / "base" / "deployment.yaml").read_text())
    assert spec["selector"]["matchLabels"] == ballast["spec"]["template"]["metadata"]["labels"]
    (container,) = ballast["spec"]["template"]["spec"]["containers"]
    assert [p["number"] for p in spec["targetPorts"]] == [container["ports"][0]["containerPort"]]
    epp_service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == ref["name"])
    assert ref["port"]["number"] in {p["port"] for p in epp_service["spec"]["ports"]}
    route = next(d for d in docs if d["kind"] == "HTTPRoute")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "ballast"}
    ]


def test_the_smg_deployment_discovers_the_ballast_pods(smg_flags: set[str]) -> None:
    docs = _docs(GATEWAY / "smg")
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["smg"] and c["args"][0] == "launch"
    assert _flags(c["args"]) <= smg_flags, _flags(c["args"]) - smg_flags
    args = c["args"]
    selector = args[args.index("--selector") + 1]
    ballast = yaml.safe_load((DEPLOY / "k8s" / "base" / "deployment.yaml").read_text())
    labels = ballast["spec"]["template"]["metadata"]["labels"]
    assert dict([selector.split("=", 1)]) == labels
    assert "--service-discovery-port=8000" in args and "--health-check-endpoint=/ready" in args
    role = next(d for d in docs if d["kind"] == "Role")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]


def test_every_metric_the_endpoint_picker_reads_is_one_ballast_serves() -> None:
    (config_map,) = [d for d in _docs(GATEWAY / "inference-pool") if d["kind"] == "ConfigMap"]
    config = yaml.safe_load(config_map["data"]["config.yaml"])
    assert config["kind"] == "EndpointPickerConfig"
    extractor = next(p for p in config["plugins"] if p["type"] == "core-metrics-extractor")
    (engine,) = extractor["parameters"]["engineConfigs"]
    assert extractor["parameters"]["defaultEngine"] == engine["name"]
    specs = {
        engine[k]
        for k in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "loraSpec", "cacheInfoSpec")
    }
    # SERIES is what /metrics serves (tests/integration/test_gateway_metrics.py checks it live).
    assert specs <= set(SERIES), specs - set(SERIES)
    assert {"block_size", "num_gpu_blocks"} <= set(SERIES["vllm:cache_config_info"])
