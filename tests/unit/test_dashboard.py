"""The chart's Grafana dashboard: valid JSON whose panels query only Hermit's metrics,
rendered into a ConfigMap by ``helm template`` when grafana.dashboard.enabled."""

from __future__ import annotations

import json
import re
import subprocess
from typing import Any

import pytest
import yaml

from hermit_common import metrics
from tests.support.chart import CHART, find_helm

DASHBOARD = CHART / "dashboards" / "hermit.json"
_SERIES_SUFFIXES = ("_bucket", "_count", "_sum")


def _panels() -> list[dict[str, Any]]:
    doc = json.loads(DASHBOARD.read_text())
    return [p for p in doc["panels"] if p["type"] != "row"]


def _metric(series: str) -> str:
    for suffix in _SERIES_SUFFIXES:
        if series.endswith(suffix) and series.removesuffix(suffix) in metrics.ALL:
            return series.removesuffix(suffix)
    return series


def test_every_panel_queries_known_metrics() -> None:
    panels = _panels()
    assert len(panels) >= 10
    queried = set()
    for panel in panels:
        assert panel["title"] and panel["targets"], panel
        for target in panel["targets"]:
            names = re.findall(r"\bhermit_[a-z_]+", target["expr"])
            assert names, f"panel {panel['title']!r} queries no Hermit metric"
            unknown = {n for n in names if _metric(n) not in metrics.ALL}
            assert unknown == set(), f"panel {panel['title']!r}: {unknown}"
            queried |= {_metric(n) for n in names}
    # Downtime, restores, checkpoint phases and bytes, notices and failures are all shown.
    assert {metrics.OPERATOR_DOWNTIME, metrics.NODE_RESTORE_SECONDS,
            metrics.NODE_CHECKPOINT_SECONDS, metrics.NODE_CHECKPOINT_BYTES,
            metrics.NODE_NOTICES, metrics.OPERATOR_RECONCILES} <= queried


def test_panels_are_unique_and_use_the_datasource_variable() -> None:
    doc = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    assert [v["name"] for v in doc["templating"]["list"]] == ["datasource"]
    for panel in _panels():
        assert panel["datasource"]["uid"] == "${datasource}"


def test_the_code_defines_every_listed_metric() -> None:
    from prometheus_client import REGISTRY

    import hermit_node.metrics  # noqa: F401  (registers the node-agent's collectors)
    import hermit_operator.metrics  # noqa: F401

    registered = {name for collector in list(REGISTRY._collector_to_names)
                  for name in REGISTRY._collector_to_names[collector]}
    for name in metrics.ALL:
        base = name.removesuffix("_total")
        assert name in registered or base in registered, name


def _render(*sets: str) -> list[dict[str, Any]]:
    helm = find_helm()
    if helm is None:
        pytest.fail("no helm binary on PATH or in ~/.cache/hermit/bin: run hack/install-helm")
    args = [helm, "template", "hermit", str(CHART), "--namespace", "hermit-system",
            "--set", "s3.bucket=checkpoints", "--set",
         "s3.scopedCredentials.roleArn=arn:aws:iam::123456789012:role/hermit-store"]
    for s in sets:
        args += ["--set", s]
    out = subprocess.run(args, check=True, capture_output=True, text=True, timeout=60).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def test_helm_renders_the_dashboard_configmap_only_when_enabled() -> None:
    assert not [d for d in _render() if d["kind"] == "ConfigMap"]
    [cm] = [d for d in _render("grafana.dashboard.enabled=true") if d["kind"] == "ConfigMap"]
    assert cm["metadata"]["namespace"] == "hermit-system"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["hermit.json"]) == json.loads(DASHBOARD.read_text())
    [moved] = [d for d in _render("grafana.dashboard.enabled=true",
                                  "grafana.dashboard.namespace=monitoring",
                                  "grafana.dashboard.annotations.grafana_folder=Hermit")
               if d["kind"] == "ConfigMap"]
    assert moved["metadata"]["namespace"] == "monitoring"
    assert moved["metadata"]["annotations"] == {"grafana_folder": "Hermit"}

