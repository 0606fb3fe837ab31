"""Every name a board or rule selects is a contract metric, a recording rule defined here, or one of
vLLM's own series a rule names (`contract.VLLM_SERIES`)."""

from __future__ import annotations

import re

import pytest

from . import contract
from .paths import DASHBOARDS_DIR, RULES_DIR
from .promcheck import board_queries, metric_names, recording_rule_names, rule_queries

RECORDED = recording_rule_names(RULES_DIR)
KNOWN = contract.series_names() | RECORDED | set(contract.VLLM_SERIES)


def test_metric_names_lexer():
    expr = (
        'histogram_quantile(0.99, sum by (le, group) (rate(kvscope_copy_duration_seconds_bucket'
        '{model_name=~"$model_name", direction="load"}[$__rate_interval]))) / on (group) group_left (kind) '
        '(kvscope:hit_ratio:rate5m offset 1h > 0.2) and bool up unless count(x{a="b,c"}) by (job)'
    )
    assert metric_names(expr) == {"kvscope_copy_duration_seconds_bucket", "kvscope:hit_ratio:rate5m", "up", "x"}


@pytest.mark.parametrize(
    "query", board_queries(DASHBOARDS_DIR) + rule_queries(RULES_DIR), ids=lambda q: q.source,
)
def test_query_selects_only_known_names(query):
    names = metric_names(query.expr)
    assert names, f"no metric found in {query.expr!r}"
    unknown = names - KNOWN
    assert not unknown, f"{query.source}: {sorted(unknown)} are neither contract metrics, recording rules nor vLLM's"


def test_recording_rules_follow_the_naming_contract():
    for name in RECORDED:
        assert re.fullmatch(r"kvscope:[a-z0-9_]+:[a-z0-9_]+", name), name
    for name in contract.series_names():
        assert ":" not in name


def test_boards_show_every_contract_metric():
    used = {contract.base_name(n) for q in board_queries(DASHBOARDS_DIR) for n in metric_names(q.expr)}
    # Recording rules shown on the boards count for the raw metrics they are built from.
    recorded_from = {
        q.source.split(" / ", 1)[1]: metric_names(q.expr) for q in rule_queries(RULES_DIR) if q.kind == "record"
    }
    frontier = [n for n in used if n in recorded_from]
    while frontier:
        for source in recorded_from[frontier.pop()]:
            base = contract.base_name(source)
            if base not in used:
                used.add(base)
                if base in recorded_from:
                    frontier.append(base)
    assert contract.all_metrics() - used == set()


def test_recording_rules_used_by_boards_exist():
    for q in board_queries(DASHBOARDS_DIR):
        for name in metric_names(q.expr):
            if ":" in name:
                assert name in RECORDED, f"{q.source}: {name} is not defined in grafana/rules"
