"""End to end without vLLM: synthetic kvscope metrics -> real Prometheus (+ rules) -> every query.

A prometheus_client exporter (tests/dashboards/synthetic_exporter.py) serves every contract metric
on 127.0.0.1; a real `prometheus` scrapes it every second and evaluates the rules every second;
then every panel query (template variables substituted), every recording rule and every alert
expression is evaluated through the HTTP API.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from . import contract
from . import synthetic_exporter as synth
from .paths import DASHBOARDS_DIR, RULE_FILES, RULES_DIR
from .promcheck import (
    board_queries, evaluate_board_queries, firing_alerts, instant_query, rule_health_failures, substitute,
)
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


# For the panel values: rate windows of twenty scrapes, and a range the data already covers.
PANEL_VALUES = {**ACTUAL_VALUES, "__rate_interval": "20s", "__interval": "5s", "__range": "40s"}
RANGE_S = 40
# How close a panel's value must come (relative): a rate drifts with the scrapes' timing on a busy machine;
# a ratio of two counters of one scrape hardly; a quantile of one bucket is exact.
RATE, RATIO, EXACT = 0.15, 0.02, 1e-6


def _expected_panel_values(instance: str, group: str) -> dict[tuple[str, str, str], dict[frozenset, tuple]]:
    """(board, panel title, refId) -> {the labels of each series: (its value, relative tolerance)}, from
    the exporter's numbers, with the filters on `synth.MODEL_NAME`, `synth.ENGINE` and KV group `group`."""
    s = synth
    model = {"model_name": s.MODEL_NAME}
    engine = {"instance": instance, "engine": s.ENGINE}

    def one(labels: dict, value: float, rel: float = RATE) -> dict[frozenset, tuple]:
        return {frozenset(labels.items()): (value, rel)}

    def per_group(value, groups=s.GROUPS, rel: float = RATE, **labels) -> dict[frozenset, tuple]:
        return {frozenset({**model, "group": g.index, "kind": g.kind, **labels}.items()): (value(g), rel)
                for g in groups}

    def request_q(q):
        return s.bucket_quantile(q, s.REQUEST_LOAD_S, s.REQUEST_LOAD_BUCKETS)

    def deferral_wait_q(q):
        return s.bucket_quantile(q, s.DEFERRAL_WAIT_S, s.DEFERRAL_WAIT_BUCKETS)

    def copy_q(q, g, direction):
        return s.bucket_quantile(q, g.copy_s[direction], s.COPY_BUCKETS)

    def scan_q(q):
        return lambda g: s.bucket_quantile(q, g.scan_s, s.SCAN_BUCKETS)

    lookup, hit = s.RATES["lookup_tokens"], s.RATES["hit_tokens"]
    (g,) = [g for g in s.GROUPS if g.index == group]
    overview = {
        ("Token hit rate (5m)", "A"): one({}, hit / lookup, RATIO),
        ("Token hit rate over time", "A"): one(model, hit / lookup, RATIO),
        ("Token hit rate over time", "B"): one(model, hit / lookup, RATIO),
        ("Tokens looked up and hit", "A"): one(model, lookup),
        ("Tokens looked up and hit", "B"): one(model, hit),
        ("Missed because evicted (5m)", "A"): one({}, s.MISSED_RATES["evicted"] / lookup, RATIO),
        ("Looked-up tokens not served, by reason", "A"): {
            frozenset({"reason": r}.items()): (rate, RATE) for r, rate in s.MISSED_RATES.items()},
        ("Blocks loaded / blocks scanned, per KV group", "A"): per_group(lambda g: g.loaded / g.scan_blocks, rel=RATIO),
        ("Null blocks skipped / blocks scanned, per KV group", "A"): per_group(
            lambda g: g.null_skipped / g.scan_blocks, rel=RATIO),
        ("Request load latency p99 (5m)", "A"): one({}, request_q(0.99), EXACT),
        ("Request load latency p50 / p95 / p99", "A"): one(model, request_q(0.5), EXACT),
        ("Request load latency p50 / p95 / p99", "B"): one(model, request_q(0.95), EXACT),
        ("Request load latency p50 / p95 / p99", "C"): one(model, request_q(0.99), EXACT),
        **{("Copy latency p50 / p99, per group and direction", ref): {
            k: v for d in contract.DIRECTIONS
            for k, v in per_group(lambda g: copy_q(q, g, d), rel=EXACT, direction=d).items()}
           for ref, q in (("A", 0.5), ("B", 0.99))},
        ("Copy throughput, per group and direction", "A"): per_group(lambda g: g.loaded * g.block_bytes),
        ("Copy throughput, per group and direction", "B"): per_group(lambda g: g.stored * g.block_bytes),
        ("Host tier usage (fullest)", "A"): one({}, s.HOST_USED_FRACTION, EXACT),
        ("Host tier used vs capacity", "A"): one(engine, s.HOST_USED_FRACTION * s.HOST_CAPACITY_BYTES, EXACT),
        ("Host tier used vs capacity", "B"): one(engine, s.HOST_CAPACITY_BYTES, EXACT),
        ("Evictions", "A"): one({**model, **engine}, s.RATES["evicted_blocks"]),
        ("Loads deferred for device KV room", "A"): one({**model, **engine}, 60 * s.RATES["deferred_loads"]),
        ("Wait for device KV room p50 / p99", "A"): one({**model, **engine}, deferral_wait_q(0.5), EXACT),
        ("Wait for device KV room p50 / p99", "B"): one({**model, **engine}, deferral_wait_q(0.99), EXACT),
        ("Load failures in range", "A"): one({}, s.RATES["load_failures"] * RANGE_S),
        ("Load failures over time", "A"): one({**model, **engine}, 60 * s.RATES["load_failures"]),
        ("Trace records dropped in range", "A"): one({}, sum(s.DROPPED_RATES.values()) * RANGE_S),
        ("Trace records dropped over time", "A"): {
            frozenset({"reason": r}.items()): (60 * s.DROPPED_RATES.get(r, 0.0), RATE) for r in s.LOSS_REASONS},
    }
    groups = {
        ("Blocks scanned, skipped and loaded", "A"): per_group(lambda g: g.scan_blocks, [g]),
        ("Blocks scanned, skipped and loaded", "B"): per_group(lambda g: g.null_skipped, [g]),
        ("Blocks scanned, skipped and loaded", "C"): per_group(lambda g: g.loaded, [g]),
        ("Scan duration p50 / p99", "A"): per_group(scan_q(0.5), [g], EXACT),
        ("Scan duration p50 / p99", "B"): per_group(scan_q(0.99), [g], EXACT),
        **{("Copy latency p50 / p99 by direction", ref): {
            frozenset({**model, "direction": d}.items()): (copy_q(q, g, d), EXACT) for d in contract.DIRECTIONS}
           for ref, q in (("A", 0.5), ("B", 0.99))},
        ("Copy throughput by direction", "A"): one(model, g.loaded * g.block_bytes),
        ("Copy throughput by direction", "B"): one(model, g.stored * g.block_bytes),
        ("Bandwidth while copying", "A"): one(
            model, g.loaded * g.block_bytes / (s.OBSERVATIONS_PER_S * g.copy_s["load"])),
        ("Bandwidth while copying", "B"): one(
            model, g.stored * g.block_bytes / (s.OBSERVATIONS_PER_S * g.copy_s["store"])),
        ("Copies per second and mean copy size", "A"): {
            frozenset({**model, "direction": d}.items()): (s.OBSERVATIONS_PER_S, RATE) for d in contract.DIRECTIONS},
        ("Copies per second and mean copy size", "B"): one(model, g.loaded * g.block_bytes / s.OBSERVATIONS_PER_S),
    }
    return {**{("kvscope-overview.json", *k): v for k, v in overview.items()},
            **{("kvscope-groups.json", *k): v for k, v in groups.items()}}


def _wait_for_data(prom_url: str, seconds: float) -> None:
    """Prometheus holds more than `seconds` of scrapes, so a range that long is covered."""
    deadline = time.monotonic() + seconds + WAIT_S
    while time.monotonic() < deadline:
        samples = f"count_over_time(kvscope_load_failures_total[{int(seconds) + 10}s]) > {seconds + 2}"
        if instant_query(prom_url, samples):
            return
        time.sleep(1)
    pytest.fail(f"Prometheus has not scraped {seconds}s of data")


def panel_value_problems(prom_url: str, dashboards_dir, instance: str, group: str) -> list[str]:
    """Every panel query of the boards in `dashboards_dir` whose series (labels, values) are not what the
    synthetic exporter scraped as `instance` produces (KV group `group` picked); one line each."""
    expected = _expected_panel_values(instance, group)
    variables = {**PANEL_VALUES, "group": group}
    problems, seen = [], set()
    for q in board_queries(dashboards_dir):
        if q.kind != "panel":
            continue
        board, panel = q.source.split(" / ", 1)
        key = (board, *panel.rsplit(" / ", 1))
        seen.add(key)
        if key not in expected:
            problems.append(f"{q.source}: no expected value in this test")
            continue
        result = instant_query(prom_url, substitute(q.expr, variables))
        got = {frozenset(r["metric"].items()): float(r["value"][1]) for r in result}
        want = expected[key]
        # A legend names each label its series carry, or two lines read alike (the groups board's rows
        # are one group each).
        unnamed = {label for labels in want for label, _ in labels} - set(re.findall(r"\{\{\s*(\w+)\s*\}\}", q.legend))
        if unnamed - ({"group"} if board == "kvscope-groups.json" else set()):
            problems.append(f"{q.source}: legend {q.legend!r} does not name {sorted(unnamed)}")
        if set(got) != set(want):
            problems.append(f"{q.source}: series {sorted(map(str, map(dict, got)))}, "
                            f"expected {sorted(map(str, map(dict, want)))}")
            continue
        problems += [f"{q.source} {dict(labels)}: {got[labels]}, expected {value}"
                     for labels, (value, rel) in want.items()
                     if got[labels] != pytest.approx(value, rel=rel, abs=1e-12)]
    problems += [f"{' / '.join(key)}: not on the boards" for key in sorted(set(expected) - seen)]
    return problems


@pytest.mark.parametrize("group", [g.index for g in synth.GROUPS])
def test_every_panel_computes_what_the_exporter_produces(warmed_up, exporter, group):
    """Each panel query's series (labels and values) against what the synthetic exporter produces: a query
    that runs but reads a sibling metric, a swapped ratio, another quantile, a lost filter or grouping
    label, or a range that is not the dashboard's, shows the wrong number here."""
    _wait_for_data(warmed_up.url, RANGE_S)
    assert panel_value_problems(warmed_up.url, DASHBOARDS_DIR, exporter.target, group) == []


def _value(prom_url: str, expr: str) -> float:
    (sample,) = instant_query(prom_url, expr)
    return float(sample["value"][1])


def test_queries_compute_what_the_exporter_produces(warmed_up):
    """Every recording rule's value against the exporter's numbers: a rule that keeps its name but reads
    a sibling metric, takes another quantile or divides the wrong way records a wrong number here."""
    url = warmed_up.url
    s = synth
    lookup = s.RATES["lookup_tokens"]

    def rate_vs_lookup(series: str) -> float:
        """A recorded 5m rate over the looked-up tokens' of the same evaluation. Prometheus has scraped
        for less than the 5 minutes, so every 5m rate is that much short of the exporter's; not their ratio."""
        return _value(url, f"{series} / ignoring (group, kind, reason) group_left kvscope:lookup_tokens:rate5m")

    assert rate_vs_lookup("kvscope:hit_tokens:rate5m") == pytest.approx(s.RATES["hit_tokens"] / lookup, rel=0.05)
    assert _value(url, "kvscope:hit_ratio:rate5m") == pytest.approx(s.RATES["hit_tokens"] / lookup, abs=0.02)
    for reason, rate in s.MISSED_RATES.items():
        assert rate_vs_lookup(f'kvscope:missed_tokens:rate5m{{reason="{reason}"}}') == pytest.approx(
            rate / lookup, rel=0.05, abs=1e-4), reason
    assert _value(url, "kvscope:evicted_miss_ratio:rate5m") == pytest.approx(
        s.MISSED_RATES["evicted"] / lookup, abs=0.005)
    for name in ("evicted_blocks", "load_failures", "deferred_loads"):
        assert rate_vs_lookup(f"kvscope:{name}:rate5m") == pytest.approx(s.RATES[name] / lookup, rel=0.05), name
    for reason in s.LOSS_REASONS:
        assert rate_vs_lookup(f'kvscope:dropped_trace_records:rate5m{{reason="{reason}"}}') == pytest.approx(
            s.DROPPED_RATES.get(reason, 0.0) / lookup, rel=0.05, abs=1e-6), reason
    for g in s.GROUPS:
        sel = f'{{group="{g.index}", kind="{g.kind}"}}'
        for name, rate in (("scan_blocks", g.scan_blocks), ("null_blocks_skipped", g.null_skipped),
                           ("loaded_blocks", g.loaded), ("load_bytes", g.loaded * g.block_bytes),
                           ("store_bytes", g.stored * g.block_bytes)):
            assert rate_vs_lookup(f"kvscope:{name}:rate5m{sel}") == pytest.approx(
                rate / lookup, rel=0.05, abs=1e-6), (name, sel)
        assert _value(url, f"kvscope:group_loaded_ratio:rate5m{sel}") == pytest.approx(
            g.loaded / g.scan_blocks, abs=0.02)
        assert _value(url, f"kvscope:group_null_skipped_ratio:rate5m{sel}") == pytest.approx(
            g.null_skipped / g.scan_blocks, abs=0.02
        )
        # Every observation of a series in one bucket: each quantile is exact and differs from the others.
        assert _value(url, f"kvscope:scan_duration_seconds:p99_rate5m{sel}") == pytest.approx(
            s.bucket_quantile(0.99, g.scan_s, s.SCAN_BUCKETS))
        for direction in contract.DIRECTIONS:
            copy = f'{{group="{g.index}", direction="{direction}"}}'
            for name, q in (("p50", 0.5), ("p99", 0.99)):
                assert _value(url, f"kvscope:copy_duration_seconds:{name}_rate5m{copy}") == pytest.approx(
                    s.bucket_quantile(q, g.copy_s[direction], s.COPY_BUCKETS)), (name, copy)
    for name, q in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99)):
        assert _value(url, f"kvscope:request_load_duration_seconds:{name}_rate5m") == pytest.approx(
            s.bucket_quantile(q, s.REQUEST_LOAD_S, s.REQUEST_LOAD_BUCKETS)), name
    for name, q in (("p50", 0.5), ("p99", 0.99)):
        assert _value(url, f"kvscope:load_deferral_wait_seconds:{name}_rate5m") == pytest.approx(
            s.bucket_quantile(q, s.DEFERRAL_WAIT_S, s.DEFERRAL_WAIT_BUCKETS)), name
    assert _value(url, "kvscope:host_usage:ratio") == pytest.approx(s.HOST_USED_FRACTION)


def test_failure_alerts_fire_and_the_others_stay_quiet(warmed_up):
    """The exporter has a steady trickle of load failures and of span records a sink failed, and is
    healthy otherwise: those two alerts fire, no other."""
    expected = {"KVScopeLoadFailures", "KVScopeTracesIncomplete"}
    deadline = time.monotonic() + 10
    alerts: dict = {}
    while time.monotonic() < deadline:
        alerts = firing_alerts(warmed_up.url)
        if all(any(a["state"] == "firing" for a in alerts.get(name, [])) for name in expected):
            break
        time.sleep(0.5)
    for name in expected:
        assert [a["state"] for a in alerts.get(name, [])] == ["firing"], alerts
    assert set(alerts) == expected, alerts
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
