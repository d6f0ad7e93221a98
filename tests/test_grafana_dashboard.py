"""examples/grafana/laps.json: valid Grafana JSON whose queries use only metric names the gateway exports."""

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from gateway.metrics import _LATENCY_BUCKETS_S, GatewayMetrics, SchedulerCollector
from laps.config import load_config, parse_config
from laps.cost import engine_traits
from policies.registry import POLICIES, make_scheduler

DASHBOARD = Path(__file__).resolve().parent.parent / "examples" / "grafana" / "laps.json"
_SAMPLE_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created"),
                    "gauge": ("",)}


def sample_names(registry: CollectorRegistry) -> set[str]:
    """Every sample name ``registry`` exposes, labelled families included before any child exists."""
    return {family.name + suffix for family in registry.collect() for suffix in _SAMPLE_SUFFIXES[family.type]}


def exported_names() -> set[str]:
    """The gateway's own metrics and every scheduling policy's ``laps_scheduler_*`` stats."""
    names = sample_names(GatewayMetrics().registry)
    config = load_config()
    for policy in sorted(POLICIES):
        scheduling = parse_config({**config.model_dump(exclude_unset=True), "scheduling": {"policy": policy}}).scheduling
        registry = CollectorRegistry()
        registry.register(SchedulerCollector(make_scheduler(scheduling, engine_traits(config)).stats))
        names |= sample_names(registry)
    return names


def dashboard_queries() -> list[str]:
    data = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in data["panels"] for t in p.get("targets", [])]


def test_the_dashboard_is_grafana_json_with_a_prometheus_datasource_variable():
    data = json.loads(DASHBOARD.read_text())
    assert data["uid"] == "laps-gateway" and data["schemaVersion"] >= 36
    variables = {v["name"]: v for v in data["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus" and variables["slo"]["current"]["value"] == "0.4"
    ids = [p["id"] for p in data["panels"]]
    assert len(ids) == len(set(ids))
    for panel in data["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"} and panel["targets"], panel["title"]


def test_every_metric_the_dashboard_queries_is_exported_by_the_gateway():
    used = {name for expr in dashboard_queries() for name in re.findall(r"\blaps_[a-z0-9_]+", expr)}
    assert len(used) >= 20
    assert sorted(used - exported_names()) == []


def test_the_slo_panel_reads_a_real_ttft_bucket_edge():
    data = json.loads(DASHBOARD.read_text())
    (slo,) = [v for v in data["templating"]["list"] if v["name"] == "slo"]
    assert {float(o["value"]) for o in slo["options"]} <= set(_LATENCY_BUCKETS_S)
