"""Latency quantile and ratio panels on an idle engine: no data, not NaN.

With no observation in the rate window every bucket rate is 0 and `histogram_quantile` gives NaN,
which a stat panel shows as "NaN" and a time series as a broken line. promtool evaluates every
quantile query of the boards over histograms that stopped moving and must find no sample; a ratio of
rates divides 0 by 0 there, and the same holds for it.
"""

from __future__ import annotations

import yaml

from . import contract
from .paths import DASHBOARDS_DIR, RULES_DIR
from .promcheck import board_queries, substitute
from .promtools import require_binary, run_promtool

VARIABLES = {"__rate_interval": "5m", "__interval": "1m", "__range": "5m", "datasource": "prometheus",
             "model_name": ".*", "instance": ".*", "engine": ".*", "group": ".*"}
ENGINE = 'model_name="tiny", engine="0"'
# Every latency histogram of the contract with the labels kvscope gives it, counts frozen (idle).
IDLE_HISTOGRAMS = {
    "kvscope_request_load_duration_seconds_bucket": ENGINE,
    "kvscope_copy_duration_seconds_bucket": ENGINE + ', group="0", kind="full_attention", direction="load"',
    "kvscope_scan_duration_seconds_bucket": ENGINE + ', group="0", kind="full_attention"',
    "kvscope_load_deferral_wait_seconds_bucket": ENGINE,
}


def _quantile_queries():
    return [q for q in board_queries(DASHBOARDS_DIR) if "histogram_quantile" in q.expr]


def _recorded_quantiles():
    """The recording rules that take a quantile (`kvscope:...:p99_rate5m` and the like)."""
    rules = [rule for path in sorted(RULES_DIR.glob("*.yaml"))
             for group in yaml.safe_load(path.read_text())["groups"] for rule in group["rules"]]
    return [rule["record"] for rule in rules if "histogram_quantile" in rule.get("expr", "")]


def _idle_counters():
    """Every counter of the contract, and each histogram's _sum and _count, with kvscope's labels, frozen."""
    extra = {"group": 'group="0"', "kind": 'kind="full_attention"', "reason": 'reason="evicted"'}
    counters = [(name, labels) for name, labels in contract.COUNTERS.items()]
    counters += [(name + suffix, labels) for name, labels in contract.HISTOGRAMS.items()
                 for suffix in ("_sum", "_count")]
    series = []
    for name, labels in counters:
        matchers = [ENGINE] + [extra[label] for label in labels if label != "direction"]
        directions = contract.DIRECTIONS if "direction" in labels else (None,)
        for d in directions:
            selector = ", ".join(matchers + ([f'direction="{d}"'] if d else []))
            series.append({"series": f"{name}{{{selector}}}", "values": "7x30"})
    return series


def _expect_no_sample_when_idle(exprs, tmp_path):
    """promtool evaluates each expression over histograms and counters that stopped moving 20 minutes ago."""
    require_binary("promtool")
    series = [{"series": f"{name}{{{labels}, le=\"{le}\"}}", "values": f"{count}x30"}
              for name, labels in IDLE_HISTOGRAMS.items() for le, count in (("0.1", 3), ("+Inf", 5))]
    series += _idle_counters()
    tests = [{"interval": "1m", "input_series": series, "promql_expr_test": [
        {"expr": expr, "eval_time": "20m", "exp_samples": []} for expr in exprs]}]
    doc = {"rule_files": [str(p) for p in sorted(RULES_DIR.glob("*.yaml"))], "evaluation_interval": "1m",
           "tests": tests}
    (tmp_path / "idle.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    result = run_promtool("test", "rules", "idle.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_latency_histogram_is_checked_idle():
    """A histogram missing here would go unchecked: its quantiles would find no series at all, idle or not."""
    assert set(IDLE_HISTOGRAMS) == {name + "_bucket" for name in contract.HISTOGRAMS}


def test_every_quantile_panel_shows_no_data_when_no_request_loads(tmp_path):
    queries = _quantile_queries()
    # the overview's load p99 stat and p50/p95/p99, copy p50/p99, deferral wait p50/p99; the groups board's 4
    assert len(queries) >= 12
    _expect_no_sample_when_idle([substitute(q.expr, VARIABLES) for q in queries], tmp_path)


def test_every_recorded_quantile_has_no_sample_when_idle(tmp_path):
    """Not only the boards' queries: each recorded quantile must skip an idle histogram too, or it
    records NaN, which a board built on it shows as "NaN" and an alert on it (load p99) reads as a value."""
    records = _recorded_quantiles()
    assert len(records) >= 8  # request load p50/p95/p99, copy p50/p99, scan p99, deferral wait p50/p99
    _expect_no_sample_when_idle(records, tmp_path)


def test_every_ratio_panel_shows_no_data_when_nothing_is_looked_up_or_copied(tmp_path):
    """Hit rate, loaded and skipped shares, bandwidth and mean copy size divide one rate by another: idle,
    that is 0 / 0, which a panel shows as NaN unless the divisor is kept only where it is above 0."""
    queries = [q for q in board_queries(DASHBOARDS_DIR) if " / " in q.expr and "histogram_quantile" not in q.expr]
    assert len(queries) >= 8  # hit rate stat and over time (2), evicted share, loaded and null shares, bandwidths...
    _expect_no_sample_when_idle([substitute(q.expr, VARIABLES) for q in queries], tmp_path)
