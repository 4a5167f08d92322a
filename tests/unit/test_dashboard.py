"""The chart's Grafana dashboard: valid JSON whose panels query only Hermit's metrics,
rendered into a ConfigMap by ``helm template`` when grafana.dashboard.enabled."""

from __future__ import annotations

import json
import re
from typing import Any

from hermit_common import metrics
from tests.support.chart import CHART, render

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
    # Downtime, restores, checkpoint phases and bytes, notices and failures are all shown;
    # so are turns, upload bandwidth, the chunk cache and lost work (issue 21, point 7).
    assert {metrics.OPERATOR_DOWNTIME, metrics.NODE_RESTORE_SECONDS,
            metrics.NODE_CHECKPOINT_SECONDS, metrics.NODE_CHECKPOINT_BYTES,
            metrics.NODE_NOTICES, metrics.OPERATOR_RECONCILES, metrics.NODE_TURNS,
            metrics.NODE_UPLOAD_WAIT_SECONDS, metrics.NODE_UPLOADS_ACTIVE,
            metrics.NODE_PREFETCH_BYTES, metrics.NODE_CHUNK_CACHE_HITS,
            metrics.NODE_CHUNK_CACHE_MISSES, metrics.OPERATOR_WORK_LOST,
            metrics.OPERATOR_SANDBOXES, metrics.NODE_NOTICE_MARGIN} <= queried


def test_panels_are_unique_and_use_the_datasource_variable() -> None:
    doc = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    assert [v["name"] for v in doc["templating"]["list"]] == ["datasource", "namespace", "node"]
    for panel in _panels():
        assert panel["datasource"]["uid"] == "${datasource}"


def test_namespace_and_node_variables_filter_every_query() -> None:
    """namespace (where Hermit runs: the scrape's label) applies to every series; node (the
    ServiceMonitor's relabeling of the node-agent's targets) to the node-agent's."""
    doc = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    for name in ("namespace", "node"):
        v = variables[name]
        assert v["type"] == "query" and v["datasource"]["uid"] == "${datasource}"
        assert v["query"]["query"].startswith("label_values(")
        assert v["query"]["query"].endswith(f", {name})")
        # "All" must also match series without the label (a Prometheus without the
        # chart's ServiceMonitor has no node label).
        assert v["includeAll"] and v["allValue"] == ".*"
    assert "$namespace" in variables["node"]["query"]["query"]
    for panel in _panels():
        for target in panel["targets"]:
            selectors = re.findall(r"\b(hermit_[a-z_]+)(\{[^}]*\})?", target["expr"])
            for name, labels in selectors:
                assert 'namespace=~"$namespace"' in labels, (panel["title"], name)
                node = 'node=~"$node"' in labels
                assert node == name.startswith("hermit_node_"), (panel["title"], name)


def test_the_code_defines_every_listed_metric() -> None:
    from prometheus_client import REGISTRY

    import hermit_node.control.metrics  # noqa: F401  (registers the node-agent's collectors)
    import hermit_operator.metrics  # noqa: F401

    registered = {name for collector in list(REGISTRY._collector_to_names)
                  for name in REGISTRY._collector_to_names[collector]}
    for name in metrics.ALL:
        base = name.removesuffix("_total")
        assert name in registered or base in registered, name


def test_helm_renders_the_dashboard_configmap_only_when_enabled() -> None:
    assert not [d for d in render() if d["kind"] == "ConfigMap"]
    [cm] = [d for d in render("grafana.dashboard.enabled=true") if d["kind"] == "ConfigMap"]
    assert cm["metadata"]["namespace"] == "hermit-system"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["hermit.json"]) == json.loads(DASHBOARD.read_text())
    [moved] = [d for d in render("grafana.dashboard.enabled=true",
                                  "grafana.dashboard.namespace=monitoring",
                                  "grafana.dashboard.annotations.grafana_folder=Hermit")
               if d["kind"] == "ConfigMap"]
    assert moved["metadata"]["namespace"] == "monitoring"
    assert moved["metadata"]["annotations"] == {"grafana_folder": "Hermit"}

