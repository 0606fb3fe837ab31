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


def test_every_quantile_panel_shows_no_data_when_no_request_loads(tmp_path):
    require_binary("promtool")
    queries = _quantile_queries()
    assert len(queries) >= 5  # the overview's p99 stat and time series, the groups board's
    series = [{"series": f"{name}{{{labels}, le=\"{le}\"}}", "values": f"{count}x30"}
              for name, labels in IDLE_HISTOGRAMS.items() for le, count in (("0.1", 3), ("+Inf", 5))]
    tests = [{"interval": "1m", "input_series": series, "promql_expr_test": [
        {"expr": substitute(q.expr, VARIABLES), "eval_time": "20m", "exp_samples": []} for q in queries]}]
    doc = {"rule_files": [str(p) for p in sorted(RULES_DIR.glob("*.yaml"))], "evaluation_interval": "1m",
           "tests": tests}
    (tmp_path / "idle.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    result = run_promtool("test", "rules", "idle.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
