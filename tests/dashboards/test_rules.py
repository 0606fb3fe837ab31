"""The Prometheus rules: valid, unit-tested (every alert firing and not firing), documented."""

from __future__ import annotations

import re

import pytest
import yaml

from .paths import GRAFANA_DIR, RULE_FILES, RULE_TESTS_DIR, RULES_DIR
from .promtools import run_promtool

RULE_TEST_FILES = sorted(RULE_TESTS_DIR.glob("*.yaml"))


def _alerts() -> list[dict]:
    return [
        rule
        for path in RULE_FILES
        for group in yaml.safe_load(path.read_text())["groups"]
        for rule in group["rules"]
        if "alert" in rule
    ]


def test_rule_files_exist():
    names = {p.name for p in RULE_FILES}
    assert {"kvscope-recording.yaml", "kvscope-alerts.yaml"} <= names


@pytest.mark.parametrize("path", RULE_FILES, ids=lambda p: p.name)
def test_promtool_check_rules(path):
    result = run_promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("path", RULE_TEST_FILES, ids=lambda p: p.name)
def test_promtool_test_rules(path):
    result = run_promtool("test", "rules", path.name, cwd=RULE_TESTS_DIR)
    assert result.returncode == 0, result.stdout + result.stderr


def test_example_prometheus_config_is_valid():
    """grafana/prometheus.yml parses and the rule files it names load (paths relative to it)."""
    result = run_promtool("check", "config", "prometheus.yml", cwd=GRAFANA_DIR)
    assert result.returncode == 0, result.stdout + result.stderr
    config = yaml.safe_load((GRAFANA_DIR / "prometheus.yml").read_text())
    loaded = {(GRAFANA_DIR / p).resolve() for p in config["rule_files"]}
    assert loaded == {p.resolve() for p in RULE_FILES}


def test_every_alert_is_documented():
    alerts = _alerts()
    assert {a["alert"] for a in alerts} == {
        "KVScopeHitRateCollapsed", "KVScopeLoadLatencyHigh", "KVScopeLoadFailures",
        "KVScopeMetricsMissing", "KVScopeStoresWithoutLoads", "KVScopeHostTierTooSmall",
        "KVScopeTracesIncomplete", "KVScopeLoadsWaitForDeviceKV",
    }
    for alert in alerts:
        annotations = alert.get("annotations") or {}
        for key in ("summary", "description", "runbook"):
            assert len(annotations.get(key, "")) > 20, f"{alert['alert']}: annotation {key!r} missing or too short"
        assert alert.get("labels", {}).get("severity") in {"warning", "critical"}, alert["alert"]


def test_every_alert_is_unit_tested_firing_and_not_firing():
    firing: set[str] = set()
    quiet: set[str] = set()
    for path in RULE_TEST_FILES:
        doc = yaml.safe_load(path.read_text())
        for case in doc.get("tests") or []:
            for check in case.get("alert_rule_test") or []:
                (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = {a["alert"] for a in _alerts()}
    assert names - firing == set(), "alerts never tested firing"
    assert names - quiet == set(), "alerts never tested not firing"


def test_rule_tests_load_the_real_rule_files():
    for path in RULE_TEST_FILES:
        doc = yaml.safe_load(path.read_text())
        for rule_file in doc["rule_files"]:
            assert (RULE_TESTS_DIR / rule_file).resolve().parent == RULES_DIR.resolve(), (path.name, rule_file)


def test_a_missing_binary_skips_with_the_install_hint():
    from .promtools import find_binary, require_binary

    assert find_binary("kvscope-no-such-binary") is None
    with pytest.raises(pytest.skip.Exception, match="install-prometheus.sh"):
        require_binary("kvscope-no-such-binary")


def test_the_host_usage_stat_shows_the_fullest_tier(tmp_path):
    """The "Host tier usage (fullest)" stat over two engines a quarter and three quarters full reads 0.75: the
    fullest one, not the emptiest nor their sum."""
    from .paths import DASHBOARDS_DIR
    from .promcheck import board_queries, substitute

    (query,) = [q for q in board_queries(DASHBOARDS_DIR) if "/ Host tier usage (fullest) /" in q.source]
    variables = {"model_name": ".*", "instance": ".*", "engine": ".*"}
    series = [{"series": f'kvscope_host_{name}_bytes{{instance="a:8000", model_name="m", engine="{engine}"}}',
               "values": f"{value}x10"}
              for engine, used in (("0", 25), ("1", 75)) for name, value in (("used", used), ("capacity", 100))]
    doc = {"rule_files": [str(p) for p in RULE_FILES], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": series,
        "promql_expr_test": [{"expr": substitute(query.expr, variables), "eval_time": "5m",
                              "exp_samples": [{"labels": "{}", "value": 0.75}]}]}]}
    (tmp_path / "fullest.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    result = run_promtool("test", "rules", "fullest.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def _bucket_edges() -> dict[str, tuple[float, ...]]:
    """Each contract histogram's bucket edges, by metric name without the `kvscope_` prefix."""
    from connector.telemetry.metrics import METRICS

    return {spec.name.removeprefix("kvscope_"): spec.buckets for spec in METRICS if spec.buckets}


def test_a_quantile_alerts_threshold_is_a_bucket_edge_of_its_histogram():
    """histogram_quantile interpolates inside a bucket: a threshold between two edges fires at a quantile that
    depends on the interpolation, not on the loads. Changing the buckets must keep (or move) the threshold."""
    edges, checked = _bucket_edges(), 0
    for alert in _alerts():
        match = re.fullmatch(r"kvscope:(\w+):p\d+_rate5m > ([\d.]+)", alert["expr"].strip())
        if match:
            metric, threshold = match[1], float(match[2])
            assert threshold in edges[metric], (alert["alert"], threshold, edges[metric])
            checked += 1
    assert checked >= 2  # KVScopeLoadLatencyHigh, KVScopeLoadsWaitForDeviceKV


@pytest.mark.parametrize("path", RULE_TEST_FILES, ids=lambda p: p.name)
def test_rule_tests_give_histograms_only_their_real_bucket_edges(path):
    """A rule test's made-up `le` values would pass against a histogram the connector never exports."""
    edges = _bucket_edges()
    for metric, le in re.findall(r'kvscope_(\w+)_bucket\{[^}]*le="([^"]+)"', path.read_text()):
        if le != "+Inf":
            assert float(le) in edges[metric], (metric, le, edges[metric])
