"""Check every board query and rule expression against a live Prometheus.

`evaluate_board_queries` is the reusable entry point: point it at any Prometheus that scrapes
kvscope metrics (the synthetic exporter here, a real vLLM engine elsewhere) and it returns one
line per problem. It does not depend on pytest.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import requests
import yaml


@dataclass(frozen=True)
class Query:
    """One PromQL expression from a board or a rules file, with where it came from."""

    source: str  # "kvscope-overview.json / Token hit rate (5m) / A", "kvscope-alerts.yaml / KVScopeLoadFailures"
    expr: str
    legend: str = ""
    kind: str = "panel"  # panel | variable | record | alert


# --- reading boards and rules ----------------------------------------------------------------

def iter_panels(panels: Iterable[dict]) -> Iterator[dict]:
    """Every panel, including those nested in (collapsed) rows."""
    for panel in panels or []:
        yield panel
        yield from iter_panels(panel.get("panels") or [])


_LABEL_VALUES = re.compile(r"^\s*label_values\((?P<selector>.+),\s*(?P<label>[A-Za-z_]\w*)\s*\)\s*$", re.S)


def board_queries(dashboards_dir: Path) -> list[Query]:
    """Panel targets and query-variable definitions of every board in `dashboards_dir`."""
    out: list[Query] = []
    for path in sorted(Path(dashboards_dir).glob("*.json")):
        board = json.loads(path.read_text())
        for variable in (board.get("templating") or {}).get("list") or []:
            if variable.get("type") != "query":
                continue
            q = variable.get("query")
            q = q.get("query", "") if isinstance(q, dict) else q or ""
            m = _LABEL_VALUES.match(q)
            # label_values(selector, label) is Grafana's; the PromQL with the same answer:
            expr = f"count by ({m['label']}) ({m['selector']})" if m else q
            out.append(Query(f"{path.name} / variable {variable['name']}", expr, kind="variable"))
        for panel in iter_panels(board.get("panels") or []):
            for target in panel.get("targets") or []:
                if target.get("expr"):
                    out.append(Query(
                        f"{path.name} / {panel.get('title', '?')} / {target.get('refId', '?')}",
                        target["expr"], target.get("legendFormat", ""),
                    ))
    return out


def rule_queries(rules_dir: Path) -> list[Query]:
    """Recording and alerting rule expressions of every rules file in `rules_dir`."""
    out: list[Query] = []
    for path in sorted(Path(rules_dir).glob("*.y*ml")):
        doc = yaml.safe_load(path.read_text()) or {}
        for group in doc.get("groups") or []:
            for rule in group.get("rules") or []:
                if "record" in rule:
                    out.append(Query(f"{path.name} / {rule['record']}", rule["expr"], kind="record"))
                elif "alert" in rule:
                    out.append(Query(f"{path.name} / {rule['alert']}", rule["expr"], kind="alert"))
    return out


def recording_rule_names(rules_dir: Path) -> set[str]:
    return {q.source.split(" / ", 1)[1] for q in rule_queries(rules_dir) if q.kind == "record"}


# --- template variables ----------------------------------------------------------------------

_VARIABLE = re.compile(r"\$\{(?P<braced>\w+)(?::[\w]+)?\}|\[\[(?P<old>\w+)\]\]|\$(?P<plain>\w+)")


def substitute(expr: str, variables: Mapping[str, str]) -> str:
    """Replace Grafana variables ($x, ${x}, ${x:fmt}, [[x]]); KeyError names an unknown one."""
    def repl(m: re.Match) -> str:
        name = m["braced"] or m["old"] or m["plain"]
        if name not in variables:
            raise KeyError(name)
        return variables[name]
    return _VARIABLE.sub(repl, expr)


# --- metric names referenced by an expression -------------------------------------------------

_KEYWORDS = {
    "and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
    "bool", "offset", "inf", "nan", "atan2",
}


def metric_names(expr: str) -> set[str]:
    """Metric (and recording rule) names an expression selects.

    A small lexer, enough for the expressions here: drop strings, label matchers, ranges,
    grouping clauses and Grafana variables; what is left that is an identifier and is not
    followed by `(` (a function or aggregation) nor a keyword is a metric name.
    """
    s = re.sub(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`', '""', expr)
    s = re.sub(r"\{[^{}]*\}", " ", s)
    s = re.sub(r"\[[^\[\]]*\]", " ", s)
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", " ", s)
    s = _VARIABLE.sub(" ", s)
    names = set()
    for m in re.finditer(r"(?<![\w.:])[A-Za-z_:][\w:]*", s):
        if s[m.end():].lstrip().startswith("("):
            continue  # function call or aggregation
        if m.group(0).lower() in _KEYWORDS:
            continue
        names.add(m.group(0))
    return names


# --- the live check --------------------------------------------------------------------------

class PromQueryError(RuntimeError):
    pass


def instant_query(prom_url: str, expr: str, timeout: float = 10) -> list[dict]:
    """Result vector of an instant query at now; raises PromQueryError on an API error."""
    try:
        resp = requests.get(f"{prom_url.rstrip('/')}/api/v1/query", params={"query": expr}, timeout=timeout)
    except requests.RequestException as exc:
        raise PromQueryError(f"request failed: {exc}") from exc
    try:
        body = resp.json()
    except ValueError as exc:
        raise PromQueryError(f"HTTP {resp.status_code}, not JSON: {resp.text[:200]}") from exc
    if body.get("status") != "success":
        raise PromQueryError(f"{body.get('errorType')}: {body.get('error')}")
    data = body["data"]
    if data["resultType"] in ("scalar", "string"):
        return [{"metric": {}, "value": data["result"]}]
    if data["resultType"] != "vector":
        raise PromQueryError(f"unexpected result type {data['resultType']}")
    return data["result"]


_LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def check_query(
    prom_url: str, query: Query, variables: Mapping[str, str], *, require_finite: bool = True,
    allow_empty: bool = False,
) -> list[str]:
    """Problems with one query: unknown variable, API error, empty, non-finite, legend label missing."""
    try:
        expr = substitute(query.expr, variables)
    except KeyError as exc:
        return [f"{query.source}: unknown template variable ${exc.args[0]} in {query.expr!r}"]
    try:
        result = instant_query(prom_url, expr)
    except PromQueryError as exc:
        return [f"{query.source}: query error {exc} for {expr!r}"]
    if not result:
        return [] if allow_empty else [f"{query.source}: empty result for {expr!r}"]
    problems = []
    if require_finite:
        bad = [(r["metric"], r["value"][1]) for r in result if not math.isfinite(float(r["value"][1]))]
        if bad:
            problems.append(f"{query.source}: non-finite values {bad} for {expr!r}")
    for label in _LEGEND_LABEL.findall(query.legend):
        if any(label not in r["metric"] for r in result):
            problems.append(f"{query.source}: legend uses {{{{{label}}}}} but a result lacks label {label!r} ({expr!r})")
    return problems


def evaluate_board_queries(
    prom_url: str,
    dashboards_dir: Path,
    rules_dir: Path,
    variables: Mapping[str, str],
    *,
    require_finite: bool = True,
    allow_empty: Iterable[str] = (),
    check_recorded_series: bool = True,
) -> list[str]:
    """Evaluate every board query and rule expression on `prom_url`; return the problems found.

    - panel targets and query variables (with `variables` substituted, e.g. model_name=".*",
      __rate_interval="30s") must return a non-empty vector of finite values whose series
      carry the labels the legend uses;
    - recording rule expressions must do the same, and (if `check_recorded_series`, i.e. the
      Prometheus loaded the rules) the recorded series must exist;
    - alert expressions must evaluate without error (empty is fine: not firing).
    `allow_empty` holds substrings of query sources that may legitimately be empty.
    """
    allow_empty = tuple(allow_empty)

    def may_be_empty(q: Query) -> bool:
        return any(s in q.source for s in allow_empty)

    problems: list[str] = []
    for q in board_queries(dashboards_dir):
        problems += check_query(prom_url, q, variables, require_finite=require_finite, allow_empty=may_be_empty(q))
    for q in rule_queries(rules_dir):
        if q.kind == "alert":
            problems += check_query(prom_url, q, {}, require_finite=False, allow_empty=True)
            continue
        problems += check_query(prom_url, q, {}, require_finite=require_finite, allow_empty=may_be_empty(q))
        if check_recorded_series:
            name = q.source.split(" / ", 1)[1]
            recorded = Query(f"{q.source} (recorded series)", name, kind="record")
            problems += check_query(prom_url, recorded, {}, require_finite=require_finite, allow_empty=may_be_empty(q))
    return problems


def rule_health_failures(prom_url: str, timeout: float = 10) -> list[str]:
    """Rules the server failed to evaluate (e.g. many-to-many matching), from /api/v1/rules."""
    body = requests.get(f"{prom_url.rstrip('/')}/api/v1/rules", timeout=timeout).json()
    problems = []
    for group in body["data"]["groups"]:
        for rule in group["rules"]:
            if rule.get("health") != "ok":
                name = rule.get("name")
                problems.append(f"{group['name']} / {name}: health {rule.get('health')}: {rule.get('lastError')}")
    return problems


def firing_alerts(prom_url: str, timeout: float = 10) -> dict[str, list[dict]]:
    """Alert name -> active alerts (state pending or firing), from /api/v1/alerts."""
    body = requests.get(f"{prom_url.rstrip('/')}/api/v1/alerts", timeout=timeout).json()
    out: dict[str, list[dict]] = {}
    for alert in body["data"]["alerts"]:
        out.setdefault(alert["labels"]["alertname"], []).append(alert)
    return out
