"""End to end without vLLM: synthetic kvscope metrics -> real Prometheus (+ rules) -> every query.

A prometheus_client exporter (tests/dashboards/synthetic_exporter.py) serves every contract metric
on 127.0.0.1; a real `prometheus` scrapes it every second and evaluates the rules every second;
then every panel query (template variables substituted), every recording rule and every alert
expression is evaluated through the HTTP API.
"""

from __future__ import annotations

import json
import time

import pytest

from . import synthetic_exporter as synth
from .paths import DASHBOARDS_DIR, RULE_FILES, RULES_DIR
from .promcheck import evaluate_board_queries, firing_alerts, instant_query, rule_health_failures
from .promtools import PrometheusServer, fast_scrape_config, require_binary

# Grafana's built-ins, as a short dashboard range would set them with 1s scrapes.
BUILTINS = {"__rate_interval": "30s", "__interval": "5s", "__range": "5m", "datasource": "prometheus"}
ALL_VALUES = {**BUILTINS, "model_name": ".*", "instance": ".*", "engine": ".*", "group": ".*"}
ACTUAL_VALUES = {**BUILTINS, "model_name": synth.MODEL_NAME, "instance": ".+", "engine": synth.ENGINE, "group": "1"}
WAIT_S = 45


@pytest.fixture(scope="module")
def exporter():
    exp = synth.SyntheticKVScopeExporter().start()
    yield exp
    exp.close()


@pytest.fixture(scope="module")
def prometheus(exporter, tmp_path_factory):
    require_binary("prometheus")
    config = fast_scrape_config("kvscope-synthetic", exporter.target, RULE_FILES)
    server = PrometheusServer(config, tmp_path_factory.mktemp("prometheus"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def warmed_up(prometheus):
    """Prometheus has scraped enough for every query, or the test fails with what is missing."""
    deadline = time.monotonic() + WAIT_S
    failures: list[str] = []
    while time.monotonic() < deadline:
        failures = evaluate_board_queries(prometheus.url, DASHBOARDS_DIR, RULES_DIR, ALL_VALUES)
        if not failures:
            return prometheus
        time.sleep(1)
    pytest.fail(
        f"after {WAIT_S}s {len(failures)} queries still fail:\n" + "\n".join(failures)
        + f"\n--- prometheus log ---\n{prometheus.log_tail()}"
    )


def test_every_query_with_all_values(warmed_up):
    assert evaluate_board_queries(warmed_up.url, DASHBOARDS_DIR, RULES_DIR, ALL_VALUES) == []


def test_every_query_with_actual_values(warmed_up):
    assert evaluate_board_queries(warmed_up.url, DASHBOARDS_DIR, RULES_DIR, ACTUAL_VALUES) == []


def test_every_rule_evaluates_without_error(warmed_up):
    assert rule_health_failures(warmed_up.url) == []


def test_filters_select_nothing_for_another_model(warmed_up):
    """The template variables really filter: another model's board is empty, not this model's data."""
    other = {**ACTUAL_VALUES, "model_name": "no-such-model"}
    failures = evaluate_board_queries(warmed_up.url, DASHBOARDS_DIR, RULES_DIR, other, check_recorded_series=False)
    board_failures = [f for f in failures if f.startswith("kvscope-")]
    assert board_failures and all("empty result" in f for f in board_failures)


def _value(prom_url: str, expr: str) -> float:
    (sample,) = instant_query(prom_url, expr)
    return float(sample["value"][1])


def test_queries_compute_what_the_exporter_produces(warmed_up):
    url = warmed_up.url
    hit_rate = synth.RATES["hit_tokens"] / synth.RATES["lookup_tokens"]
    assert _value(url, "kvscope:hit_ratio:rate5m") == pytest.approx(hit_rate, abs=0.02)
    for g in synth.GROUPS:
        sel = f'{{group="{g.index}", kind="{g.kind}"}}'
        assert _value(url, f"kvscope:group_loaded_ratio:rate5m{sel}") == pytest.approx(g.loaded / g.scan_blocks, abs=0.02)
        assert _value(url, f"kvscope:group_null_skipped_ratio:rate5m{sel}") == pytest.approx(
            g.null_skipped / g.scan_blocks, abs=0.02
        )
    # Latencies: the synthetic distributions' medians (~20 ms requests, ~2 ms copies, ~30 us scans).
    assert 0.005 < _value(url, "max(kvscope:request_load_duration_seconds:p50_rate5m)") < 0.08
    assert 0.0005 < _value(url, "max(kvscope:copy_duration_seconds:p50_rate5m)") < 0.01
    assert 5e-6 < _value(url, "max(kvscope:scan_duration_seconds:p99_rate5m)") < 1e-3
    assert 0 < _value(url, "kvscope:host_usage:ratio") <= 0.9


def test_load_failure_alert_fires_and_the_others_stay_quiet(warmed_up):
    """The exporter has a steady trickle of load failures and healthy everything else."""
    deadline = time.monotonic() + 10
    alerts: dict = {}
    while time.monotonic() < deadline:
        alerts = firing_alerts(warmed_up.url)
        if any(a["state"] == "firing" for a in alerts.get("KVScopeLoadFailures", [])):
            break
        time.sleep(0.5)
    assert [a["state"] for a in alerts.get("KVScopeLoadFailures", [])] == ["firing"], alerts
    assert set(alerts) == {"KVScopeLoadFailures"}, alerts
    (alert,) = alerts["KVScopeLoadFailures"]
    assert alert["labels"]["model_name"] == synth.MODEL_NAME and alert["labels"]["engine"] == synth.ENGINE
    assert alert["annotations"]["summary"].startswith("kvscope host-tier loads are failing for synthetic-model")


def test_the_check_reports_broken_queries(warmed_up, tmp_path):
    """The checker itself: each kind of broken query is reported, a good one is not."""
    targets = [
        ("good", 'sum(rate(kvscope_lookup_tokens_total{model_name=~"$model_name"}[$__rate_interval]))', ""),
        ("missing", "sum(rate(kvscope_no_such_metric_total[5m]))", ""),
        ("syntax", "sum(rate(kvscope_lookup_tokens_total[5m])", ""),
        ("nan", "sum(rate(kvscope_lookup_tokens_total[5m])) * 0 / 0", ""),
        ("legend", "sum(rate(kvscope_lookup_tokens_total[5m]))", "{{model_name}}"),
        ("variable", "sum(rate(kvscope_lookup_tokens_total{model_name=~\"$unknown\"}[5m]))", ""),
    ]
    board = {
        "panels": [
            {"title": title, "type": "timeseries", "targets": [{"refId": "A", "expr": expr, "legendFormat": legend}]}
            for title, expr, legend in targets
        ],
    }
    (tmp_path / "broken.json").write_text(json.dumps(board))
    empty_rules = tmp_path / "rules"
    empty_rules.mkdir()
    failures = evaluate_board_queries(warmed_up.url, tmp_path, empty_rules, ALL_VALUES)
    reported = sorted(f.split(" / ")[1] for f in failures)
    assert reported == ["legend", "missing", "nan", "syntax", "variable"], failures
