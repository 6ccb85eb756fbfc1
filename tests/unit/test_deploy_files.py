"""deploy/: dashboard, Prometheus, compose and Kubernetes files parse, fit together and name real things."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from vllm_kvevict.metrics import EvictionMetrics
from vllm_kvevict.policies.registry import available_methods

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD_PATH = DEPLOY / "grafana" / "vllm-kvevict.json"
METRIC_NAME = re.compile(r"\b(vllm:[a-z_]+|vllm_kvevict_[a-z_]+)")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count", "_total")


def load_yaml_documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD_PATH.read_text())


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


@pytest.fixture(scope="module")
def k8s_objects() -> dict[str, dict]:
    kustomization = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    objects = {}
    for resource in kustomization["resources"]:
        for doc in load_yaml_documents(DEPLOY / "k8s" / resource):
            objects[doc["kind"]] = doc
    return objects


def panel_exprs(dashboard: dict) -> list[str]:
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def our_series_names() -> set[str]:
    registry = CollectorRegistry()
    EvictionMetrics(registry)
    names = set()
    for family in registry.collect():
        names.add(family.name)
        names.update(family.name + suffix for suffix in HISTOGRAM_SUFFIXES)
    return names


def vllm_metric_names() -> set[str]:
    """Names vLLM 0.32 registers, read from its stat logger source (vLLM is not imported)."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations, "vLLM is not installed"
    source = (Path(next(iter(spec.submodule_search_locations))) / "v1" / "metrics" / "loggers.py").read_text()
    names = set(re.findall(r'name="(vllm:[a-z_]+)"', source))
    return names | {name + suffix for name in names for suffix in HISTOGRAM_SUFFIXES}


def test_dashboard_has_the_issue_panels(dashboard):
    titles = " | ".join(panel["title"].lower() for panel in dashboard["panels"])
    needles = ("with vs without eviction", "freed per second", "compression", "latency",
               "running and waiting", "generation throughput", "per-layer", "per-head")
    for needle in needles:
        assert needle in titles, needle


def test_dashboard_has_instance_model_and_datasource_variables(dashboard):
    variables = {var["name"]: var for var in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["instance"]["type"] == variables["model"]["type"] == "query"
    exprs = panel_exprs(dashboard)
    assert all('instance=~"$instance"' in expr for expr in exprs)
    assert any('model_name=~"$model"' in expr for expr in exprs)


def test_every_panel_is_complete_and_has_a_unique_id(dashboard):
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["title"] and panel["description"] and panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}"
        assert {"x", "y", "w", "h"} <= panel["gridPos"].keys()
        refs = [target["refId"] for target in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]


def test_panels_do_not_overlap(dashboard):
    cells = set()
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24
        xs, ys = range(pos["x"], pos["x"] + pos["w"]), range(pos["y"], pos["y"] + pos["h"])
        mine = {(x, y) for x in xs for y in ys}
        assert not cells & mine, panel["title"]
        cells |= mine


def test_dashboard_names_only_metrics_that_exist(dashboard):
    known = our_series_names() | vllm_metric_names()
    referenced = {name for expr in panel_exprs(dashboard) for name in METRIC_NAME.findall(expr)}
    assert referenced - known == set()
    assert any(name.startswith("vllm_kvevict_") for name in referenced)


def test_every_eviction_metric_appears_on_the_dashboard(dashboard):
    text = " ".join(panel_exprs(dashboard))
    registry = CollectorRegistry()
    EvictionMetrics(registry)
    families = {family.name for family in registry.collect()}
    missing = {name for name in families if name not in text}
    assert missing == set()


def test_step_phases_on_the_dashboard_are_exactly_the_recorded_ones(dashboard):
    """A panel must not promise a phase no code records (issue 13: "scoring"/"compaction" never were)."""
    from vllm_kvevict.metrics import STEP_PHASES

    [panel] = [p for p in dashboard["panels"] if "eviction_step_seconds" in json.dumps(p["targets"])]
    text = json.dumps(panel).lower()
    filtered = set(re.findall(r'phase\s*=~?\s*\\"([a-z|]+)', text))
    named = {phase for phase in ("total", "scoring", "selection", "compaction") if f"phase {phase}" in text}
    assert filtered <= set(STEP_PHASES)
    assert named == set(STEP_PHASES), named


def test_heatmap_panels_ask_prometheus_for_heatmap_frames(dashboard):
    heatmaps = [panel for panel in dashboard["panels"] if panel["type"] == "heatmap"]
    assert len(heatmaps) == 2
    for panel in heatmaps:
        assert all(target["format"] == "heatmap" for target in panel["targets"])
        assert panel["options"]["calculate"] is False


def test_prometheus_scrapes_the_compose_vllm_service(compose):
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = [t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    assert targets == ["vllm:8000"]
    assert "--port=8000" in compose["services"]["vllm"]["command"]


def test_compose_runs_vllm_with_eviction_prometheus_and_grafana(compose):
    services = compose["services"]
    assert set(services) == {"vllm", "prometheus", "grafana"}
    command = services["vllm"]["command"]
    assert command[0] == "serve" and any(arg.startswith("--kv-eviction=") for arg in command)
    assert services["vllm"]["environment"]["VLLM_USE_V2_MODEL_RUNNER"] == "0"


def test_compose_bind_mounts_and_build_files_exist(compose):
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name}: {source}"
    build = compose["services"]["vllm"]["build"]
    context = (DEPLOY / build["context"]).resolve()
    assert (context / build["dockerfile"]).is_file()


def test_dockerfile_copies_existing_paths():
    context = DEPLOY.parent
    for line in (DEPLOY / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (context / source).exists(), source


def test_grafana_provisioning_points_at_the_mounted_dashboard(compose):
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/vllm-kvevict.yaml").read_text())
    folder = provider["providers"][0]["options"]["path"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in compose["services"]["grafana"]["volumes"]}
    assert mounts[f"{folder}/vllm-kvevict.json"] == "./grafana/vllm-kvevict.json"
    datasources = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yaml").read_text())
    assert datasources["datasources"][0]["url"] == "http://prometheus:9090"


def test_eviction_flags_in_deploy_files_name_registered_methods(compose, k8s_objects):
    methods = {info.name for info in available_methods()}
    args = k8s_objects["Deployment"]["spec"]["template"]["spec"]["containers"][0]["args"]
    k8s_method = next(arg.split("=", 1)[1] for arg in args if arg.startswith("--kv-eviction="))
    assert k8s_method in methods
    compose_arg = next(a for a in compose["services"]["vllm"]["command"] if a.startswith("--kv-eviction="))
    assert re.fullmatch(r"--kv-eviction=\$\{KV_EVICTION_METHOD:-([a-z-]+)\}", compose_arg).group(1) in methods


def test_k8s_deployment_requests_a_gpu_and_is_scraped(k8s_objects):
    pod = k8s_objects["Deployment"]["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert any(arg.startswith("--kv-budget=") for arg in container["args"])
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"


def test_k8s_service_and_servicemonitor_select_the_pods(k8s_objects):
    pod_labels = k8s_objects["Deployment"]["spec"]["template"]["metadata"]["labels"]
    service = k8s_objects["Service"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    monitor = k8s_objects["ServiceMonitor"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    port_names = {port["name"] for port in service["spec"]["ports"]}
    assert {endpoint["port"] for endpoint in monitor["spec"]["endpoints"]} <= port_names


def test_k8s_dashboard_configmap_matches_the_dashboard_json(k8s_objects):
    configmap = k8s_objects["ConfigMap"]
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(configmap["data"]["vllm-kvevict.json"]) == json.loads(DASHBOARD_PATH.read_text())
