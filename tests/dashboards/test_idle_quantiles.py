"""Latency quantile panels on an idle engine: no data, not NaN.

With no observation in the rate window every bucket rate is 0 and `histogram_quantile` gives NaN,
which a stat panel shows as "NaN" and a time series as a broken line. promtool evaluates every
quantile query of the boards over histograms that stopped moving and must find no sample.
"""

from __future__ import annotations

import yaml

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
}


def _quantile_queries():
    return [q for q in board_queries(DASHBOARDS_DIR) if "histogram_quantile" in q.expr]


def _recorded_quantiles():
    """The recording rules that take a quantile (`kvscope:...:p99_rate5m` and the like)."""
    rules = [rule for path in sorted(RULES_DIR.glob("*.yaml"))
             for group in yaml.safe_load(path.read_text())["groups"] for rule in group["rules"]]
    return [rule["record"] for rule in rules if "histogram_quantile" in rule.get("expr", "")]


def _expect_no_sample_when_idle(exprs, tmp_path):
    """promtool evaluates each expression over histograms whose counts stopped moving 20 minutes ago."""
    require_binary("promtool")
    series = [{"series": f"{name}{{{labels}, le=\"{le}\"}}", "values": f"{count}x30"}
              for name, labels in IDLE_HISTOGRAMS.items() for le, count in (("0.1", 3), ("+Inf", 5))]
    tests = [{"interval": "1m", "input_series": series, "promql_expr_test": [
        {"expr": expr, "eval_time": "20m", "exp_samples": []} for expr in exprs]}]
    doc = {"rule_files": [str(p) for p in sorted(RULES_DIR.glob("*.yaml"))], "evaluation_interval": "1m",
           "tests": tests}
    (tmp_path / "idle.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    result = run_promtool("test", "rules", "idle.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_quantile_panel_shows_no_data_when_no_request_loads(tmp_path):
    queries = _quantile_queries()
    assert len(queries) >= 5  # the overview's p99 stat and time series, the groups board's
    _expect_no_sample_when_idle([substitute(q.expr, VARIABLES) for q in queries], tmp_path)


def test_every_recorded_quantile_has_no_sample_when_idle(tmp_path):
    """Not only the boards' queries: each recorded quantile must skip an idle histogram too, or it
    records NaN, which a board built on it shows as "NaN" and an alert on it (load p99) reads as a value."""
    records = _recorded_quantiles()
    assert len(records) >= 6  # request load p50/p95/p99, copy p50/p99, scan p99
    _expect_no_sample_when_idle(records, tmp_path)
