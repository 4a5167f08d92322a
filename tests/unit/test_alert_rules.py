"""Hermit's alerting rules (charts/hermit/rules/hermit.rules.yaml, docs/metrics.md#alerts):
promtool checks the file and runs its unit tests (hermit.rules.test.yaml: every alert fires
on synthetic series, healthy series fire nothing); the rules query only metrics the code
defines; the chart's PrometheusRule carries exactly the file's groups, and only when
metrics.prometheusRule.enabled."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from hermit_common import metrics
from tests.support.chart import CHART, VALUES, WITH_BUCKET, errors, merged, render

RULES = CHART / "rules" / "hermit.rules.yaml"
RULES_TEST = CHART / "rules" / "hermit.rules.test.yaml"
# Series the rules read that are not Hermit's, and where they come from (docs/metrics.md).
EXTERNAL = {"up": "Prometheus's scrape of each target",
            "kube_daemonset_status_number_unavailable": "kube-state-metrics"}
_SUFFIXES = ("_bucket", "_count", "_sum")
_NOT_METRICS = {"unless", "or", "and", "bool"}


def _promtool() -> str:
    cached = Path(os.environ.get("HERMIT_CACHE", Path.home() / ".cache" / "hermit")) / "bin"
    found = shutil.which("promtool") or shutil.which("promtool", path=str(cached))
    if found is None:
        pytest.fail("no promtool binary on PATH or in ~/.cache/hermit/bin: run "
                    "hack/install-promtool (builds it from the Go module proxy; hack/bootstrap "
                    "runs it)")
    return found


def _promtool_run(*args: str) -> str:
    done = subprocess.run([_promtool(), *args], capture_output=True, text=True, timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"promtool {' '.join(args)} failed:\n{out}"
    return out


def _rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def _alerts() -> set[str]:
    return {rule["alert"] for rule in _rules()}


def test_promtool_checks_the_rules_file() -> None:
    out = _promtool_run("check", "rules", str(RULES))
    assert f"SUCCESS: {len(_rules())} rules found" in out, out


def test_promtool_unit_tests_fire_every_alert() -> None:
    out = _promtool_run("test", "rules", str(RULES_TEST))
    assert "SUCCESS" in out, out
    # The test file covers every alert firing, and some evaluation expecting silence.
    cases = [case for test in yaml.safe_load(RULES_TEST.read_text())["tests"]
             for case in test["alert_rule_test"]]
    assert {c["alertname"] for c in cases if c["exp_alerts"]} == _alerts()
    assert [c for c in cases if not c["exp_alerts"]]


def _metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression selects (label matchers, groupings, ranges,
    offsets and function calls dropped)."""
    e = re.sub(r"\{[^}]*\}", "", expr)
    e = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", e)
    e = re.sub(r"\[[^\]]*\]", "", e)
    e = re.sub(r"\boffset\s+\w+", "", e)
    names = set(re.findall(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\b(?!\s*\()", e))
    return names - _NOT_METRICS


def _base(series: str) -> str:
    for suffix in _SUFFIXES:
        if series.endswith(suffix) and series.removesuffix(suffix) in metrics.ALL:
            return series.removesuffix(suffix)
    return series


def test_rules_query_only_metrics_the_code_defines() -> None:
    """A renamed metric breaks this test (the names are hermit_common.metrics.ALL, which
    test_dashboard.py checks against the registered collectors)."""
    queried: set[str] = set()
    for rule in _rules():
        names = _metric_names(rule["expr"])
        assert names, rule["alert"]
        unknown = {n for n in names if _base(n) not in metrics.ALL and n not in EXTERNAL}
        assert unknown == set(), f"{rule['alert']} queries {unknown}"
        queried |= {_base(n) for n in names}
    assert {metrics.NODE_NOTICE_MARGIN, metrics.NODE_CHECKPOINT_FAILURES,
            metrics.OPERATOR_WORK_LOST, metrics.OPERATOR_SANDBOXES} <= queried
    assert set(EXTERNAL) <= queried


def test_every_alert_has_severity_summary_and_runbook() -> None:
    for rule in _rules():
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), rule["alert"]
        assert rule["annotations"]["summary"], rule["alert"]
        anchor = rule["alert"].lower()
        assert f"Runbook: docs/metrics.md#{anchor}" in rule["annotations"]["description"]
        # The runbook section the anchor points at exists.
        assert f"### {rule['alert']}\n" in (CHART.parents[1] / "docs" / "metrics.md").read_text()


def test_chart_values_are_the_rules_files_own_settings() -> None:
    """values.yaml's metrics.prometheusRule.alerts restate the file, so the defaults render
    it unchanged; `threshold` is the number the alert's expression ends with."""
    settings = VALUES["metrics"]["prometheusRule"]["alerts"]
    assert set(settings) == _alerts()
    for rule in _rules():
        s = settings[rule["alert"]]
        assert s["for"] == rule["for"] and s["severity"] == rule["labels"]["severity"], s
        if "threshold" in s:
            last = re.search(r"(-?[0-9.]+)\s*$", rule["expr"])
            assert last is not None and float(last.group(1)) == s["threshold"], rule["alert"]


@pytest.mark.parametrize(("override", "path"), [
    ({"alerts": {"HermitWorkLost": {"severity": "page"}}},
     "metrics.prometheusRule.alerts.HermitWorkLost.severity"),
    ({"alerts": {"HermitWorkLost": {"for": "ten minutes"}}},
     "metrics.prometheusRule.alerts.HermitWorkLost.for"),
    ({"alerts": {"HermitWorkLost": {"threshold": "600"}}},
     "metrics.prometheusRule.alerts.HermitWorkLost.threshold"),
    # An alert without a threshold in its expression takes none.
    ({"alerts": {"HermitOperatorDown": {"threshold": 1}}},
     "metrics.prometheusRule.alerts.HermitOperatorDown"),
    ({"alerts": {"HermitTypo": {"enabled": False}}}, "metrics.prometheusRule.alerts"),
    ({"enabled": "yes"}, "metrics.prometheusRule.enabled"),
    ({"additionalLabels": {"release": 1}}, "metrics.prometheusRule.additionalLabels.release"),
])
def test_schema_names_a_bad_prometheus_rule_value(override: dict[str, Any], path: str) -> None:
    found = errors(merged(WITH_BUCKET, {"metrics": {"prometheusRule": override}}))
    assert any(e.startswith(f"{path}:") for e in found), found


def _rule_docs(*sets: str) -> list[dict[str, Any]]:
    return [d for d in render(*sets) if d["kind"] == "PrometheusRule"]


def test_helm_renders_the_prometheus_rule_only_when_enabled() -> None:
    assert _rule_docs() == []
    [rule] = _rule_docs("metrics.prometheusRule.enabled=true",
                        "metrics.prometheusRule.additionalLabels.release=prometheus")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == "hermit-system"
    assert rule["metadata"]["labels"]["release"] == "prometheus"
    assert rule["metadata"]["labels"]["app.kubernetes.io/name"] == "hermit"
    # Exactly the rules file's groups: the file promtool tests is the file that ships.
    assert rule["spec"] == yaml.safe_load(RULES.read_text())


def test_helm_applies_per_alert_values(tmp_path: Path) -> None:
    [rule] = _rule_docs("metrics.prometheusRule.enabled=true",
                        "metrics.prometheusRule.alerts.HermitWorkLost.threshold=900",
                        "metrics.prometheusRule.alerts.HermitWorkLost.for=10m",
                        "metrics.prometheusRule.alerts.HermitWorkLost.severity=critical",
                        "metrics.prometheusRule.alerts.HermitOperatorDown.enabled=false")
    rendered = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    original = {r["alert"]: r for r in _rules()}
    assert set(rendered) == set(original) - {"HermitOperatorDown"}
    lost = rendered["HermitWorkLost"]
    assert lost["expr"] == re.sub(r"300$", "900", original["HermitWorkLost"]["expr"])
    assert lost["for"] == "10m" and lost["labels"]["severity"] == "critical"
    for name, r in rendered.items():
        if name != "HermitWorkLost":
            assert r == original[name], name
    # What the chart rendered from the values is still a valid rule file.
    path = tmp_path / "rendered.rules.yaml"
    path.write_text(yaml.safe_dump(rule["spec"]))
    _promtool_run("check", "rules", str(path))
