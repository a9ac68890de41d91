"""deploy/k8s: every overlay renders (kubectl's built-in kustomize) into resources that pass
`kubernetes-validate` against the newest Kubernetes schema it ships, strictly (no unknown fields);
and the pieces agree with each other and with the server: the container's command line and
variables pass the CLI's strict configuration path, the probes hit /ready and /health, the HPA
scales on metrics the adapter rules serve, the PrometheusRule is the alert-rules file.

ServiceMonitor and PrometheusRule are CRDs of the Prometheus Operator: kubernetes-validate has no
schema for them (it raises SchemaNotFoundError), so they are checked here by their fields."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from ballast.server.cli import LAYERS, OTHER_VARIABLES, build_parser
from ballast.server.config import build, unknown_variables

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu")
KUBECTL = shutil.which("kubectl")
CRDS = {"ServiceMonitor", "PrometheusRule"}


def render(overlay: str) -> list[dict[str, Any]]:
    if KUBECTL is None:
        pytest.skip(
            "kubectl (which has kustomize built in) is not installed; `kubectl kustomize` renders the "
            "overlays"
        )
    out = subprocess.run(
        [KUBECTL, "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True, check=True
    )
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    kinds = [d["kind"] for d in docs]
    assert len(kinds) == len(set(kinds)), kinds
    return {d["kind"]: d for d in docs}


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (c,) = by_kind(docs)["Deployment"]["spec"]["template"]["spec"]["containers"]
    return c


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_resources_pass_the_kubernetes_schema(overlay: str) -> None:
    docs = render(overlay)
    version = kubernetes_validate.latest_version()
    assert set(by_kind(docs)) == {
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
        *CRDS,
    }
    for doc in docs:
        if doc["kind"] in CRDS:
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(doc, version, strict=True)
            assert doc["apiVersion"] == "monitoring.coreos.com/v1"
            continue
        kubernetes_validate.validate(doc, version, strict=True)  # raises ValidationError with the path


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_container_passes_the_configuration_path_and_probes_the_right_endpoints(overlay: str) -> None:
    docs = render(overlay)
    c = container(docs)
    env = {e["name"]: e["value"] for e in c["env"]}
    assert len(env) == len(c["env"]), "a variable is set twice"
    parser, _ = build_parser()
    args = parser.parse_args(c["args"])
    assert args.command == "serve"
    for layer in LAYERS:
        build(layer, args, env)  # raises ConfigError on any bad value
    assert unknown_variables(env, LAYERS, OTHER_VARIABLES) == []
    port = c["ports"][0]
    assert port["containerPort"] == int(c["args"][c["args"].index("--port") + 1]) and port["name"] == "http"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready" and c["readinessProbe"]["failureThreshold"] == 1
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["startupProbe"]["httpGet"]["path"] == "/ready"
    res = c["resources"]
    # The memory limit is the cgroup memory.max ballast measures its levels against; asking for
    # the same amount keeps the kubelet from evicting the pod before ballast's own reserve acts.
    assert res["limits"]["memory"] == res["requests"]["memory"]
    gpus = res["limits"].get("nvidia.com/gpu")
    assert (gpus == "1") == (overlay == "gpu") and (env.get("BALLAST_DEVICE") == "cuda") == (overlay == "gpu")
    assert c["image"] == f"ballast:{'cuda' if overlay == 'gpu' else 'cpu'}"
    assert (
        c["securityContext"]["readOnlyRootFilesystem"]
        and not c["securityContext"]["allowPrivilegeEscalation"]
    )


def test_the_pieces_select_each_other() -> None:
    docs = by_kind(render("cpu"))
    pod_labels = docs["Deployment"]["spec"]["template"]["metadata"]["labels"]
    for kind, selector in (
        ("Deployment", docs["Deployment"]["spec"]["selector"]["matchLabels"]),
        ("Service", docs["Service"]["spec"]["selector"]),
        ("PodDisruptionBudget", docs["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"]),
    ):
        assert selector and selector.items() <= pod_labels.items(), kind
    monitor = docs["ServiceMonitor"]["spec"]
    assert monitor["selector"]["matchLabels"].items() <= docs["Service"]["metadata"]["labels"].items()
    assert {e["port"] for e in monitor["endpoints"]} <= {p["name"] for p in docs["Service"]["spec"]["ports"]}
    assert monitor["endpoints"][0]["path"] == "/metrics"
    hpa = docs["HorizontalPodAutoscaler"]["spec"]
    assert hpa["scaleTargetRef"]["name"] == docs["Deployment"]["metadata"]["name"] and hpa["minReplicas"] >= 2
    assert docs["PodDisruptionBudget"]["spec"]["maxUnavailable"] < hpa["minReplicas"]


def test_the_hpa_scales_on_metrics_the_adapter_serves() -> None:
    hpa = by_kind(render("cpu"))["HorizontalPodAutoscaler"]["spec"]
    wanted = {m["pods"]["metric"]["name"] for m in hpa["metrics"] if m["type"] == "Pods"}
    adapter = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())
    served = {r["name"]["as"] for r in adapter["rules"]["custom"]}
    assert wanted == {"ballast_queue_depth", "ballast_memory_pressure_level"} and wanted <= served
    for rule in adapter["rules"]["custom"]:
        # the series the adapter looks for carry the pod labels the HPA asks by
        assert rule["name"]["as"] in rule["seriesQuery"] and set(rule["resources"]["overrides"]) == {
            "namespace",
            "pod",
        }
    # ...and ballast serves them: docs/OPERATIONS.md's metric table is checked against a live
    # /metrics by test_deploy_files.py.
    guide = (K8S.parents[1] / "docs" / "OPERATIONS.md").read_text()
    assert all(f"`{m}`" in guide for m in wanted)


def test_prometheusrule_is_the_alert_rules_file() -> None:
    rule = by_kind(render("cpu"))["PrometheusRule"]
    plain = yaml.safe_load((K8S.parent / "prometheus" / "ballast.rules.yml").read_text())
    assert rule["spec"]["groups"] == plain["groups"]
    alerts = {r["alert"]: r for g in plain["groups"] for r in g["rules"]}
    assert alerts["BallastMemoryCritical"]["for"] == "1m"
    assert {
        "BallastRefusingForMemory",
        "BallastQueueFull",
        "BallastQueueSaturated",
        "BallastGpuLedgerNearCeiling",
    } <= set(alerts)
